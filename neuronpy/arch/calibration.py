"""A fixed, varied text whose activations calibrate the int8 mode's smoothing."""

from __future__ import annotations

CALIBRATION_TEXT = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Explain how a refrigerator keeps food cold, then give me a short poem about winter.<|im_end|>
<|im_start|>assistant
A refrigerator moves heat from the inside of the box to the room around it. A pump called
the compressor squeezes a refrigerant gas, which heats it up; the hot gas gives its heat away
in the coils at the back and condenses into a liquid. The liquid then passes through a narrow
valve, expands, and evaporates inside the cold coils, absorbing heat from the food.

Snow on the rooftops, silence in the lane,
the kettle is singing, the frost on the pane.

Prices rose 3.7% in March, after 2.9% in February; the central bank kept its rate at 4.25%.
def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]
La capitale de la France est Paris. Der schnelle braune Fuchs springt über den faulen Hund.
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; chlorophyll
absorbs mostly red and blue light, which is why leaves look green. In 1969, Apollo 11 landed
on the Moon, and Neil Armstrong said: "That's one small step for man, one giant leap for
mankind." To make pancakes, whisk 200 g of flour, 2 eggs, 300 ml of milk and a pinch of salt.
"""
