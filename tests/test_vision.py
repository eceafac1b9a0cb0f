"""Images in the conversation: a vision-language checkpoint built by transformers (the tiny
SmolVLM-family fixture) served as a user serves a model directory. Its replies to messages
with images, sent by the real `openai`, `anthropic` and `ollama` clients, are transformers'
greedy replies to the same images and text, alone and batched with text-only requests; bad
images get a 400 naming the part and change nothing else."""

from __future__ import annotations

import base64
import http.server
import io
import pickle
import threading
import time
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from neuronpy.engine.types import SamplingParams
from neuronpy.media import Media, Prompt, media_key, past_image, split_media_id, text_ids
from neuronpy.server.images import ImageInput, image_marker, render_with_images
from neuronpy.server.prompts import render_chat
from tests.servers import FIXTURES, RunningServer, engine_loader, process_loader, run_server
from tests.test_engine_parity import concurrently, one_at_a_time
from tests.test_fixtures import bf

MODEL = bf.VISION_FIXTURE
PATH = FIXTURES / MODEL
GEMMA = FIXTURES / bf.GEMMA_VISION_FIXTURE
MAX_TOKENS = 12
QUESTION = "What is in the picture?"


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    """A random RGB picture, `size` (width, height)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


PICTURES = [picture(1, (56, 40)), picture(2, (30, 30)), picture(3, (20, 90))]


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def b64(image: Image.Image) -> str:
    return base64.b64encode(png(image)).decode()


def data_uri(image: Image.Image) -> str:
    return f"data:image/png;base64,{b64(image)}"


def openai_message(text: str, *images: Image.Image) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_uri(i)}} for i in images
    ]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@cache
def reference(path: Path = PATH) -> tuple[Any, Any]:
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return processor, model


def transformers_reply(
    text: str,
    *images: Image.Image,
    max_tokens: int = MAX_TOKENS,
    content: Any = None,
    path: Path = PATH,
    sanitize: bool = False,
) -> str:
    """transformers' greedy reply to a user message of `images` then `text` (or of its
    `content` parts as given), through the model's processor and chat template
    (`sanitize`: control tokens in the text encoded as text, where the processor can)."""
    processor, model = reference(path)
    content = content or [
        *({"type": "image", "image": i} for i in images),
        {"type": "text", "text": text},
    ]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        sanitize_control_tokens=sanitize,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    return processor.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with run_server({MODEL: engine_loader(PATH, max_in_flight=8)}) as running:
        yield running


def ask(server: RunningServer, messages: list[dict[str, Any]], **extra: Any) -> Any:
    api = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    return api.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        **extra,
    )


# ---- media ids --------------------------------------------------------------------------


def test_media_ids_name_the_image_and_the_place_and_survive_pickling() -> None:
    inputs = {"pixel_values": np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)}
    media = Media(media_key(inputs), 3, inputs)
    ids = media.ids()
    assert all(t < 0 for t in ids) and len(set(ids)) == 3
    assert [split_media_id(t) for t in ids] == [(media.number, j) for j in range(3)]
    other = Media(media_key({"pixel_values": inputs["pixel_values"] + 1}), 3, inputs)
    assert not set(other.ids()) & set(ids), "two images' tokens never share an id"
    prompt = Prompt([5, *ids, 7], [media])
    again = pickle.loads(pickle.dumps(prompt))
    assert again == prompt and again.media[0].key == media.key
    assert text_ids(again, placeholder=9) == [5, 9, 9, 9, 7]


def test_the_prompt_is_the_processors_with_media_ids_at_the_image_tokens() -> None:
    processor, _ = reference()
    tokenizer = processor.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    ids = render_chat(tokenizer, messages)
    prompt = render_with_images(
        processor, image_marker(tokenizer), ids, [ImageInput(PICTURES[0], "x", 0)]
    )
    want = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": PICTURES[0]}, messages[0]["content"][1]],
            }
        ],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    want = list(np.asarray(want).reshape(-1))
    image_token = processor.image_token_id
    assert text_ids(prompt, image_token) == want
    (media,) = prompt.media
    assert media.tokens == want.count(image_token) == 20  # 4 tiles and the whole, 4 tokens each


# ---- parity -----------------------------------------------------------------------------


def test_openai_image_messages_are_transformers_greedy_replies(server: RunningServer) -> None:
    for text, images in [
        (QUESTION, PICTURES[:1]),
        ("Describe it.", PICTURES[1:2]),
        ("Compare them.", PICTURES[:2]),
        ("No picture here.", []),
    ]:
        reply = ask(server, [openai_message(text, *images)])
        assert reply.choices[0].message.content == transformers_reply(text, *images), text
        assert reply.usage is not None and reply.usage.prompt_tokens > 20 * len(images)


@pytest.mark.anyio
async def test_image_rows_batched_with_text_rows_are_transformers_replies() -> None:
    """The lockstep batch with image and text-only rows together (each joins while the
    others decode): every reply is the one it gets alone, and transformers'."""
    cases = [
        (QUESTION, PICTURES[:1]),
        ("Tell me a story", []),
        ("Describe it.", PICTURES[2:3]),
        ("Numbers: 1, 2, 3", []),
        ("Compare them.", PICTURES[:2]),
    ]
    await alone_and_batched(PATH, cases)


@pytest.mark.anyio
async def test_gemma3_image_tokens_see_their_whole_image_batched_with_text() -> None:
    """Gemma 3: an image's tokens attend to the whole image at prefill (transformers' replies
    differ without it), prefilled 4 tokens at a time alone and in 16-token rides of a
    decoding batch (an image's run of tokens never cut), batched with text-only rows."""
    cases = [
        (QUESTION, PICTURES[:1]),
        ("Tell me a story", []),
        ("Describe it.", PICTURES[2:3]),
        ("Compare them.", PICTURES[:2]),
    ]
    await alone_and_batched(GEMMA, cases, prefill_chunk=4)


def test_a_gemma3_checkpoint_served_to_the_openai_client() -> None:
    """Its prompt is its processor's (images expanded as transformers writes them, the user's
    text encoded as text) and its replies transformers'."""
    name = bf.GEMMA_VISION_FIXTURE
    with run_server({name: engine_loader(GEMMA)}) as server:
        api = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        for text, images in [("Look <start_of_image> here.", PICTURES[1:2]), (QUESTION, [])]:
            reply = api.chat.completions.create(
                model=name,
                messages=[openai_message(text, *images)],  # type: ignore[list-item]
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
            want = transformers_reply(text, *images, path=GEMMA, sanitize=True)
            assert reply.choices[0].message.content == want, text


def test_a_prefill_chunk_never_cuts_an_image() -> None:
    a = Media("a" * 64, 4, {}).ids()
    b = Media("b" * 64, 4, {}).ids()
    prompt = [1, 2, *a, *b, 3]
    assert [past_image(prompt, end) for end in range(len(prompt) + 1)] == [
        0,
        1,
        2,
        6,
        6,
        6,
        6,
        10,
        10,
        10,
        10,
        11,
    ]


@pytest.mark.anyio
async def test_an_images_tiles_are_encoded_with_the_chunks_that_hold_them_once() -> None:
    """Joining a batch that decodes, a prompt rides the steps 16 tokens at a time (its
    prefill chunk is 8: the least ride is 16), and its image of 5 tiles (4 tokens each) is
    encoded a few tiles per chunk, each tile once; another request of the same image encodes
    nothing."""
    engine = engine_loader(PATH, prefill_chunk=8, compile="off")()
    calls: list[range | None] = []
    async with engine:
        vision = engine._worker.vision
        encode = vision.encode

        def counted(inputs: Any, tiles: range | None = None) -> torch.Tensor:
            calls.append(tiles)
            return encode(inputs, tiles)

        vision.encode = counted  # type: ignore[method-assign]
        jobs = [
            (_prompt(engine, "Tell me a story", []), _greedy()),
            (_prompt(engine, QUESTION, PICTURES[:1]), _greedy()),
        ]
        first = (await concurrently(engine, jobs))[1]
        assert len(calls) > 1 and sorted(k for r in calls for k in r or ()) == list(range(5))
        calls.clear()
        # (text before the image: no cached prefix holds it)
        after = [{"type": "text", "text": "Look."}, {"type": "image"}]
        ids = render_chat(engine.tokenizer, [{"role": "user", "content": after}])
        image = [ImageInput(PICTURES[0], "image", 0)]
        prompt = render_with_images(engine.processor, image_marker(engine.tokenizer), ids, image)
        other = await engine.complete(prompt, _greedy())
        assert calls == [], "the image's rows were kept"
    assert first.text == transformers_reply(QUESTION, PICTURES[0])
    after[1]["image"] = PICTURES[0]
    assert other.text == transformers_reply("", content=after)


async def alone_and_batched(
    path: Path, cases: list[tuple[str, list[Image.Image]]], **config: Any
) -> None:
    """Each case's reply alone (one row at a time) and batched (each joining the decoding
    batch in turn: they share it): the same tokens, and transformers' reply."""
    alone_engine = engine_loader(path, max_in_flight=1, compile="off", **config)()
    async with alone_engine:
        assert alone_engine.model.bidirectional_images == (path == GEMMA)
        jobs = [(_prompt(alone_engine, text, images), _greedy()) for text, images in cases]
        alone = await one_at_a_time(alone_engine, jobs)
    batched_engine = engine_loader(path, max_in_flight=8, **config)()
    async with batched_engine:
        together = await concurrently(batched_engine, jobs)
        stats = batched_engine.stats()
    assert stats.max_batch_size >= 3, "the rows never shared a batch"
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for (text, images), done in zip(cases, together, strict=True):
        assert done.text == transformers_reply(text, *images, path=path), text


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _prompt(engine: Any, text: str, images: list[Image.Image]) -> list[int]:
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    ids = render_chat(engine.tokenizer, messages, images=images, processor=engine.processor)
    if not images:
        return ids
    pictures = [ImageInput(i, f"image {k}", 0) for k, i in enumerate(images)]
    return render_with_images(engine.processor, image_marker(engine.tokenizer), ids, pictures)


def test_a_follow_up_turn_reuses_the_images_prefix_and_another_image_does_not(
    server: RunningServer,
) -> None:
    first = [openai_message(QUESTION, PICTURES[0])]
    reply = ask(server, first).choices[0].message.content or ""
    follow_up = [*first, {"role": "assistant", "content": reply}, openai_message("And?")]
    again = ask(server, follow_up)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= 32, "the first turn's prompt, image and all, came from the prefix cache"
    swapped = [openai_message(QUESTION, PICTURES[2]), *follow_up[1:]]
    other = ask(server, swapped)
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) < 16, (
        "another image at the same place never matches the first one's KV"
    )


def test_tokenize_counts_an_images_tokens_as_the_processor_writes_them(
    server: RunningServer,
) -> None:
    processor, _ = reference()
    body = {"model": MODEL, "messages": [openai_message(QUESTION, PICTURES[0])]}
    out = httpx.post(f"{server.url}/tokenize", json=body).json()
    content = [{"type": "image", "image": PICTURES[0]}, {"type": "text", "text": QUESTION}]
    want = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    assert out["tokens"] == list(np.asarray(want).reshape(-1)) and out["count"] == len(
        out["tokens"]
    )


def test_the_responses_api_takes_input_image(server: RunningServer) -> None:
    api = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    content = [
        {"type": "input_image", "image_url": data_uri(PICTURES[1])},
        {"type": "input_text", "text": QUESTION},
    ]
    out = api.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": content}],  # type: ignore[list-item]
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert out.output_text == transformers_reply(QUESTION, PICTURES[1])


def test_anthropic_image_blocks(server: RunningServer) -> None:
    api = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(PICTURES[0])},
    }
    out = api.messages.create(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},  # (the SDK takes no sampling parameters any more)
        messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}],  # type: ignore[list-item]
    )
    assert out.content[0].text == transformers_reply(QUESTION, PICTURES[0])  # type: ignore[union-attr]


def test_ollama_images(server: RunningServer) -> None:
    api = ollama.Client(host=server.url, timeout=120)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    chat = api.chat(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION, "images": [png(PICTURES[2])]}],
        options=options,
    )
    assert chat.message.content == transformers_reply(QUESTION, PICTURES[2])
    generated = api.generate(
        model=MODEL, prompt=QUESTION, images=[png(PICTURES[2])], options=options
    )
    assert generated.response == chat.message.content


# ---- bad images -------------------------------------------------------------------------


def _truncated() -> str:
    raw = png(picture(5, (64, 64)))
    return base64.b64encode(raw[: len(raw) // 2]).decode()


def _bomb() -> str:
    """A small PNG file of 60 million pixels."""
    out = io.BytesIO()
    Image.new("L", (10_000, 6_000)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


BAD_IMAGES = {
    "not-an-image": (
        "data:image/png;base64," + base64.b64encode(b"hello" * 20).decode(),
        "not an image",
    ),
    "not-base64": ("data:image/png;base64,@@@@", "base64"),
    "truncated": ("data:image/png;base64," + _truncated(), "cannot be decoded"),
    "bomb": ("data:image/png;base64," + _bomb(), "million"),
    "remote": ("https://example.com/cat.png", "no remote images"),
    "not-a-data-uri": ("file:///etc/passwd", "data: URI"),
    "svg": ("data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=", "image/svg+xml"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_a_bad_image_is_a_400_naming_its_part(server: RunningServer, case: str) -> None:
    url, words = BAD_IMAGES[case]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": data_uri(PICTURES[0])}},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        ask(server, messages)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == "messages[0].content[2].image_url", error
    assert words in error["message"], error


def test_too_many_images_and_bad_parts_are_400s(server: RunningServer) -> None:
    many = openai_message(QUESTION, *[PICTURES[0]] * 9)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(server, [many])
    assert refused.value.body["param"] == "messages[0].content[8].image_url"  # type: ignore[index]
    body = {
        "model": MODEL,
        "messages": [
            {"role": "assistant", "content": [openai_message("x", PICTURES[0])["content"][0]]}
        ],
    }
    response = httpx.post(f"{server.v1}/chat/completions", json=body)
    assert response.status_code == 400 and "user" in response.json()["error"]["message"]
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    response = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [bad]}]},
    )
    assert response.status_code == 400
    assert "messages[0].content[0].source" in response.json()["error"]["message"]
    response = httpx.post(
        f"{server.url}/api/chat",
        json={
            "model": MODEL,
            "stream": False,
            "messages": [{"role": "user", "content": "x", "images": ["AAAA"]}],
        },
    )
    assert response.status_code == 400 and "messages[0].images[0]" in response.json()["error"]


def test_a_bad_image_changes_nothing_for_the_requests_beside_it(server: RunningServer) -> None:
    want = transformers_reply(QUESTION, PICTURES[1])

    async def run() -> tuple[list[str], list[int]]:
        replies: list[str] = []
        statuses: list[int] = []
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0) as api:

            async def good() -> None:
                out = await api.chat.completions.create(
                    model=MODEL,
                    messages=[openai_message(QUESTION, PICTURES[1])],  # type: ignore[list-item]
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                )
                replies.append(out.choices[0].message.content or "")

            async def bad() -> None:
                try:
                    await api.chat.completions.create(
                        model=MODEL,
                        messages=[
                            {
                                "role": "user",
                                "content": [
                                    {
                                        "type": "image_url",
                                        "image_url": {"url": BAD_IMAGES["truncated"][0]},
                                    }
                                ],
                            }
                        ],
                        max_tokens=MAX_TOKENS,
                    )
                except openai.BadRequestError as exc:
                    statuses.append(exc.status_code)

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(good if i % 2 else bad)
        return replies, statuses

    replies, statuses = anyio.run(run)
    assert replies == [want] * 3 and statuses == [400] * 3
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_text_model_refuses_images_by_part() -> None:
    with run_server({"tiny-llama": engine_loader(FIXTURES / "tiny-llama")}) as text_only:
        api = openai.OpenAI(base_url=text_only.v1, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(
                model="tiny-llama",
                messages=[openai_message(QUESTION, PICTURES[0])],  # type: ignore[list-item]
                max_tokens=4,
            )
    assert refused.value.body["param"] == "messages[0].content[0].image_url"  # type: ignore[index]
    assert "reads no images" in refused.value.body["message"]  # type: ignore[index]


# ---- images by URL (--image-urls) ---------------------------------------------------------


def test_only_global_addresses_are_public() -> None:
    from neuronpy.server.image_urls import is_public_address

    private = [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # a cloud's metadata service
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fc00::1",
        "fe80::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
    ]
    assert not any(is_public_address(a) for a in private)
    assert all(is_public_address(a) for a in ("8.8.8.8", "1.1.1.1", "2606:4700::1111"))


class _Images(http.server.BaseHTTPRequestHandler):
    """What the URL tests fetch from: a PNG, HTML, a redirect, a large PNG, a 404, and a
    server that never answers."""

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(30)
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        if self.path == "/missing.png":
            self.send_error(404)
            return
        kind, body = {
            "/cat.png": ("image/png", png(PICTURES[2])),
            "/page.html": ("text/html", b"<html></html>"),
            "/big.png": ("image/png", png(picture(9, (400, 400)))),
        }[self.path]
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    host.daemon_threads = True
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()


def test_image_urls_are_fetched_only_when_allowed_and_never_from_private_addresses(
    image_host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from neuronpy.server import image_urls

    def refused(server: RunningServer, url: str) -> str:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(
                server,
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": QUESTION},
                        ],
                    }
                ],
            )
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == "messages[0].content[0].image_url"
        return str(body["message"])

    with run_server({MODEL: engine_loader(PATH)}, image_urls=True) as server:
        # allowed, but the host is this machine: never fetched
        assert "not a public address" in refused(server, f"{image_host}/cat.png")
        # (the test's host taken for a public one: what an internet host would get)
        monkeypatch.setattr(image_urls, "is_public_address", lambda address: True)
        message = openai_message(QUESTION)
        message["content"].insert(
            0, {"type": "image_url", "image_url": {"url": f"{image_host}/cat.png"}}
        )
        reply = ask(server, [message]).choices[0].message.content
        assert reply == transformers_reply(QUESTION, PICTURES[2])
        assert "text/html" in refused(server, f"{image_host}/page.html")
        assert "redirects" in refused(server, f"{image_host}/redirect")
        assert "HTTP 404" in refused(server, f"{image_host}/missing.png")
        monkeypatch.setattr(image_urls, "MAX_IMAGE_BYTES", 1000)
        assert "larger than" in refused(server, f"{image_host}/big.png")
        monkeypatch.setattr(image_urls, "FETCH_SECONDS", 0.5)
        assert "not fetched within" in refused(server, f"{image_host}/slow.png")
        assert "data: URI" in refused(server, "file:///etc/passwd")


def test_a_session_keeps_an_images_turn_across_a_restart(tmp_path: Path) -> None:
    """A conversation with an image saved as a session (its KV and its media ids): after a
    restart its next turn continues from the file, and the reply is transformers'."""
    first = [openai_message(QUESTION, PICTURES[1])]
    with run_server({MODEL: engine_loader(PATH)}, sessions_dir=tmp_path) as server:
        reply = ask(server, first, extra_body={"session": "pictures"}).choices[0].message
    turn = [*first, {"role": "assistant", "content": reply.content}, openai_message("And?")]
    with run_server({MODEL: engine_loader(PATH)}, sessions_dir=tmp_path) as restarted:
        again = ask(restarted, turn, extra_body={"session": "pictures"})
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 32
    processor, model = reference()
    content = [{"type": "image", "image": PICTURES[1]}, {"type": "text", "text": QUESTION}]
    conversation = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": reply.content}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]},
    ]
    inputs = processor.apply_chat_template(
        conversation,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    want = processor.tokenizer.decode(ids, skip_special_tokens=True)
    assert again.choices[0].message.content == want


def test_served_with_its_engine_in_a_process_of_its_own() -> None:
    """As `neuronpy serve` runs it: the prompt's images cross to the engine's process."""
    with run_server({MODEL: process_loader(PATH, compile="off")}) as server:
        reply = ask(server, [openai_message(QUESTION, PICTURES[0])])
    assert reply.choices[0].message.content == transformers_reply(QUESTION, PICTURES[0])
