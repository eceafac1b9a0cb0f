"""Input-grounded chat prompts: requests whose replies copy long spans of their own prompt.

Speculative decoding with prompt lookup (n-gram drafting) proposes, as the next few tokens, the
continuation of the most recent earlier occurrence of the last few tokens in the prompt and the
output so far. It pays off when the reply repeats text from the prompt, as it does when a model
is asked to edit a text and return it in full. This module builds such requests.

There are four prompt styles, taking turns by request index:

- "typo": fix the one misspelled word of a short passage and return the passage in full;
- "json_edit": change one given value of a JSON configuration and return the whole JSON;
- "json_fix": put back the one missing comma of a JSON configuration;
- "list_append": add one task to the end of a numbered to-do list and return the whole list.

They were chosen by measuring SmolLM2-135M-Instruct (the default model) with greedy decoding:
on these, its replies are close copies of the source text, without loops. It makes the
requested change in most JSON replies, but seldom in the passage and list ones, which it copies
as they are. Styles whose replies stop being copies were left out: asked to rename a variable or
change one line of Python code, it rewrites the code; asked to quote one sentence, it copies the
whole passage; asked to change one entry of a list of records, it loops over the records.

Every text is generated here from small templates and word lists with a seeded `random.Random`,
so request `index` is the same text on every run and every machine, and different indices give
different texts. Only the standard library is used.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

Messages = list[dict[str, str]]

# ---------------------------------------------------------------------------------------------
# word lists


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_SYLLABLES = _words(
    "ka lo mi ren to va sel dor an bri en ul mar tis or fen ha quil ro ta wen zo ber ny"
)
_NOUNS = _words(
    "order invoice sensor ticket player basket route parcel record tenant lesson signal sample "
    "voyage harvest lantern ledger crate meter visit booking reading shipment"
)
_COLORS = ("green", "grey", "red", "golden", "blue", "brown", "silver", "white")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_BUILDINGS = ("library", "mill", "chapel", "granary", "lighthouse", "town hall", "inn", "forge")
_GOODS = ("wool", "salt", "timber", "honey", "flour", "cheese", "copper", "linen", "apples")
_SPICES = ("cinnamon", "clove", "ginger", "pepper", "rosemary", "thyme", "fennel", "saffron")
_MATERIALS = ("stone", "oak", "iron", "brick", "cedar", "slate")
_TREES = ("chestnut trees", "lime trees", "pear trees", "birches", "poplars", "walnut trees")
_TOYS = ("marbles", "painted stones", "paper kites", "wooden tops", "seashells", "buttons")
_FEATURES = ("doors", "windows", "staircase", "bell", "clock", "fireplace", "weathervane")
_ANIMALS = ("goats", "geese", "sheep", "ponies", "ducks", "hens")
_TRADES = ("baker", "weaver", "carpenter", "potter", "blacksmith", "tailor", "cobbler")
_SERVICES = ("billing", "gateway", "scheduler", "indexer", "mailer", "catalog", "reports")
_HOSTS = ("db-main", "db-replica", "store01", "pg-east", "data-west", "cluster-a")
_LOG_LEVELS = ("debug", "info", "warning", "error")


def _name(rng: random.Random) -> str:
    """A made-up proper name of two or three syllables, such as 'Renvalo'."""
    count = rng.choice((2, 2, 3))
    return "".join(rng.choice(_SYLLABLES) for _ in range(count)).capitalize()


def _distinct_names(rng: random.Random, count: int) -> list[str]:
    """`count` different made-up names."""
    names: list[str] = []
    while len(names) < count:
        name = _name(rng)
        if name not in names:
            names.append(name)
    return names


# ---------------------------------------------------------------------------------------------
# source texts

_SENTENCES = (
    "The village of {place} lies at the foot of the {color} hills, about {n1} miles from the "
    "coast.",
    "Every {day}, {person} opens a small bakery beside the old {building}.",
    "Most of the {goods} sold in the market is brought by cart from the farms of {place2}.",
    "In the spring of {year}, a storm damaged the roof of the {building2}, and the repairs took "
    "{n2} weeks.",
    "{person2} keeps a careful record of every boat that enters the harbour.",
    "The local school has {n3} pupils and a single teacher named {person3}.",
    "Visitors often remark on the smell of {spice} that drifts from the kitchens in the evening.",
    "A narrow bridge of {material} crosses the river just below the mill.",
    "The council meets on the first {day2} of each month to discuss the price of {goods2}.",
    "Children gather by the fountain after supper to trade {toys}.",
    "Nobody remembers exactly who planted the row of {trees} along the main road.",
    "The {building3} was built by the grandfather of {person4} and still has its original "
    "{feature}.",
    "On market days the square fills with {animals}, and the noise can be heard from the church.",
    "The only {trade} in the village, {person5}, learned the craft in the city of {place3}.",
    "Travellers who arrive late are usually given a bed at the house of {person6}.",
    "Each autumn the families of the valley hold a festival to celebrate the {goods3} harvest.",
)


def _passage(rng: random.Random, count: int) -> tuple[list[str], set[str]]:
    """A short passage about an imaginary village: its `count` sentences and the names in it."""
    people = _distinct_names(rng, 9)
    slots = {
        "place": people[0],
        "place2": people[1],
        "place3": people[2],
        "person": people[3],
        "person2": people[4],
        "person3": people[5],
        "person4": people[6],
        "person5": people[7],
        "person6": people[8],
        "color": rng.choice(_COLORS),
        "day": rng.choice(_DAYS),
        "day2": rng.choice(_DAYS),
        "building": rng.choice(_BUILDINGS),
        "building2": rng.choice(_BUILDINGS),
        "building3": rng.choice(_BUILDINGS),
        "goods": rng.choice(_GOODS),
        "goods2": rng.choice(_GOODS),
        "goods3": rng.choice(_GOODS),
        "spice": rng.choice(_SPICES),
        "material": rng.choice(_MATERIALS),
        "trees": rng.choice(_TREES),
        "toys": rng.choice(_TOYS),
        "feature": rng.choice(_FEATURES),
        "animals": rng.choice(_ANIMALS),
        "trade": rng.choice(_TRADES),
        "year": str(rng.randint(1820, 1990)),
        "n1": str(rng.randint(3, 40)),
        "n2": str(rng.randint(2, 12)),
        "n3": str(rng.randint(12, 90)),
    }
    # the village name always opens the passage; the other sentences are a random subset
    rest = sorted(rng.sample(range(1, len(_SENTENCES)), count - 1))
    chosen = [_SENTENCES[0]] + [_SENTENCES[i] for i in rest]
    return [s.format(**slots) for s in chosen], set(people)


def _misspell(rng: random.Random, word: str) -> str:
    """`word` with one spelling mistake: two inner letters swapped, one doubled or one dropped."""
    i = rng.randrange(1, len(word) - 2)
    kind = rng.randrange(3)
    if kind == 0 and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    if kind == 1:
        return word[: i + 1] + word[i] + word[i + 1 :]
    return word[:i] + word[i + 1 :]


def _config(rng: random.Random) -> dict[str, object]:
    """A flat service configuration (no nested objects), as a JSON-ready dict."""
    service = rng.choice(_SERVICES)
    return {
        "service": f"{service}-{_name(rng).lower()}",
        "port": rng.choice((8000, 8080, 8443, 9000, 9090, 5000)),
        "log_level": rng.choice(_LOG_LEVELS),
        "timeout_seconds": rng.choice((10, 15, 30, 45, 60, 120)),
        "max_retries": rng.randint(1, 8),
        "database_host": rng.choice(_HOSTS),
        "pool_size": rng.choice((4, 8, 10, 16, 20, 32)),
        "cache_enabled": rng.choice((True, False)),
        "cache_ttl_seconds": rng.choice((60, 300, 600, 3600)),
        "owner": f"{_name(rng).lower()}@example.com",
    }


_TASKS = (
    "buy {n} jars of {goods} at the market",
    "call {person} about the {building} roof",
    "return the {noun} book to the library",
    "pay the {trade} for the new {feature}",
    "water the {trees} in the back garden",
    "write a letter to {person2} in {place}",
    "take the {animals} to the field by the river",
    "pick up {n2} sacks of {goods2} from the mill",
    "fix the {feature} of the {building2}",
    "book a room at the inn for {person3}",
    "send the {noun2} report to {person4}",
    "clean the {material} steps by the front door",
)


def _todo(rng: random.Random) -> list[str]:
    """A to-do list of 7 to 9 different tasks."""
    people = _distinct_names(rng, 5)
    slots = {
        "n": str(rng.randint(2, 9)),
        "n2": str(rng.randint(2, 9)),
        "goods": rng.choice(_GOODS),
        "goods2": rng.choice(_GOODS),
        "person": people[0],
        "person2": people[1],
        "person3": people[2],
        "person4": people[3],
        "place": people[4],
        "building": rng.choice(_BUILDINGS),
        "building2": rng.choice(_BUILDINGS),
        "noun": rng.choice(_NOUNS),
        "noun2": rng.choice(_NOUNS),
        "trade": rng.choice(_TRADES),
        "feature": rng.choice(_FEATURES),
        "trees": rng.choice(_TREES),
        "animals": rng.choice(_ANIMALS),
        "material": rng.choice(_MATERIALS),
    }
    tasks = [t.format(**slots) for t in rng.sample(_TASKS, rng.randint(7, 9))]
    return [t[0].upper() + t[1:] for t in tasks]


# ---------------------------------------------------------------------------------------------
# prompt styles


@dataclass(frozen=True)
class GroundedRequest:
    """One input-grounded request: its chat messages and the reply a perfect model would give.

    `expected` is the ideal reply (the source text with the requested change made), for checking
    whether a model did the task; the workload itself only sends `messages`.
    """

    style: str
    messages: Messages
    expected: str


def _system(role: str, request: str, reply: str) -> dict[str, str]:
    """A system message stating the assistant's job, with one worked example.

    The small default model follows an edit request far more often with the example than
    without it.
    """
    return {
        "role": "system",
        "content": f"{role}\n\nExample request: {request}\nExample reply: {reply}",
    }


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _typo(rng: random.Random) -> tuple[Messages, str]:
    """Fix the one misspelled word of a short passage and return the passage in full."""
    sentences, names = _passage(rng, rng.randint(4, 6))
    correct = " ".join(sentences)
    words = [
        (si, w)
        for si, s in enumerate(sentences)
        for w in s.rstrip(".").replace(",", "").split()
        if len(w) >= 6 and w.isalpha() and w.islower() and w not in names
    ]
    si, word = rng.choice(words)
    sentences[si] = sentences[si].replace(word, _misspell(rng, word), 1)
    system = _system(
        "You fix spelling mistakes. You copy the text in full with the misspelled word corrected.",
        "Fix the misspelled word: The dog slept under the tabel all day.",
        "The dog slept under the table all day.",
    )
    text = (
        "The paragraph below contains one misspelled word. Rewrite the whole paragraph with "
        "the spelling corrected.\n\n" + " ".join(sentences)
    )
    return [system, _user(text)], correct


def _json_edit(rng: random.Random) -> tuple[Messages, str]:
    """Change one given value of a JSON configuration and return the whole configuration."""
    config = _config(rng)
    key = rng.choice(("port", "timeout_seconds", "max_retries", "pool_size", "cache_ttl_seconds"))
    old = config[key]
    assert isinstance(old, int)
    new = old + rng.choice((1, 5, 10, 100))
    text = (
        f"```json\n{json.dumps(config, indent=2)}\n```\n\n"
        f'In this JSON, change "{key}": {old} to "{key}": {new}. Reply with the full JSON only.'
    )
    config[key] = new
    return [_user(text)], f"```json\n{json.dumps(config, indent=2)}\n```"


def _json_fix(rng: random.Random) -> tuple[Messages, str]:
    """Put back the one missing comma of a JSON configuration and return the whole of it."""
    good = json.dumps(_config(rng), indent=2)
    lines = good.split("\n")
    at = rng.randrange(2, len(lines) - 2)  # a line that ends with a comma
    lines[at] = lines[at].removesuffix(",")
    broken = "\n".join(lines)
    text = (
        f"```json\n{broken}\n```\n\n"
        "This JSON does not parse because a comma is missing. Reply with the corrected JSON only."
    )
    return [_user(text)], f"```json\n{good}\n```"


def _list_append(rng: random.Random) -> tuple[Messages, str]:
    """Add one task to the end of a numbered to-do list and return the whole list."""
    tasks = _todo(rng)
    extra = tasks.pop()
    lines = [f"{i + 1}. {t}" for i, t in enumerate(tasks)]
    new = f"{len(tasks) + 1}. {extra}"
    system = _system(
        "You edit lists exactly as asked. You copy the list in full and make only the requested "
        "change.",
        'Add "3. Feed the cat" to this list:\n1. Wash the car\n2. Buy bread',
        "1. Wash the car\n2. Buy bread\n3. Feed the cat",
    )
    text = (
        "My to-do list:\n\n"
        + "\n".join(lines)
        + f'\n\nAdd "{new}" to this list and write out the whole list.'
    )
    return [system, _user(text)], "\n".join([*lines, new])


STYLE_BUILDERS: dict[str, Callable[[random.Random], tuple[Messages, str]]] = {
    "typo": _typo,
    "json_edit": _json_edit,
    "json_fix": _json_fix,
    "list_append": _list_append,
}
STYLES: tuple[str, ...] = tuple(STYLE_BUILDERS)


def style_request(style: str, index: int, seed: int = 0) -> GroundedRequest:
    """Request `index` written in prompt style `style` (one of STYLES)."""
    try:
        build = STYLE_BUILDERS[style]
    except KeyError:
        raise ValueError(f"unknown grounded style {style!r}; known: {', '.join(STYLES)}") from None
    messages, expected = build(random.Random(f"grounded:{seed}:{style}:{index}"))
    return GroundedRequest(style, messages, expected)


def grounded_style(index: int) -> str:
    """The prompt style of request `index`: the styles take turns, in the order of STYLES."""
    return STYLES[index % len(STYLES)]


def grounded_request(index: int, seed: int = 0) -> GroundedRequest:
    """Request `index` of the input-grounded workload, with the reply it asks for."""
    return style_request(grounded_style(index), index, seed)


def grounded_messages(index: int, seed: int = 0) -> Messages:
    """The OpenAI chat messages of request `index` of the input-grounded workload.

    The same (index, seed) always gives the same messages, and different indices give different
    texts. A request is one user message, after a system message for some styles.
    """
    return grounded_request(index, seed).messages
