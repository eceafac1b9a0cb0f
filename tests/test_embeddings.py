"""Embeddings (`/v1/embeddings`): parity with transformers' own forward on a Qwen3-Embedding-
shaped fixture, an input's vector the same alone or batched with others of other lengths,
the pooling read from the checkpoint's sentence-transformers config (or the model's config),
the task an embedding-only model serves, and every input shape and error through the real
`openai` client."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from neuronpy.compose import resolve_pooling
from neuronpy.config import EngineConfig
from neuronpy.engine.embeddings import Pooling
from neuronpy.loading import load_pretrained, sentence_transformers_pooling
from neuronpy.server.scoring import RERANK_INSTRUCTION, rerank_prompt
from tests.servers import FIXTURES, RunningServer, engine_loader, run_server
from tests.test_fixtures import bf

EMBED = bf.EMBEDDING_FIXTURE
CHAT = "tiny-qwen3"
MEAN = "tiny-qwen3-mean"  # the chat fixture's embeddings, mean-pooled and not normalized
RERANKER = bf.RERANKER_FIXTURE
CHUNK = 64  # the servers' prefill_chunk: an embedding job's token budget
TEXTS = [
    "The quick brown fox",
    "café 日本語 🙂",
    "In 1984 the station",
    "a",
    "The quick brown fox jumps over the lazy dog, and then the station in 1984",
]


def reference(name: str, texts: list[str], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' own forward of the checkpoint (AutoModel: the decoder without its head),
    one text at a time, pooled as sentence-transformers pools: the oracle."""
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / name)
    model = AutoModel.from_pretrained(FIXTURES / name, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            hidden = model(ids).last_hidden_state[0]
        vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
        out.append(F.normalize(vector, dim=0) if normalize else vector)
    return torch.stack(out)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    models = {
        EMBED: engine_loader(FIXTURES / EMBED, prefill_chunk=CHUNK),
        CHAT: engine_loader(FIXTURES / CHAT, prefill_chunk=CHUNK),
        MEAN: engine_loader(FIXTURES / CHAT, pooling="mean", normalize=False),
        RERANKER: engine_loader(FIXTURES / RERANKER, task="rerank", prefill_chunk=CHUNK * 4),
    }
    with run_server(models) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def vectors(out: Any) -> torch.Tensor:
    assert [d.index for d in out.data] == list(range(len(out.data)))
    return torch.tensor([d.embedding for d in out.data], dtype=torch.float32)


def test_pooling_is_read_from_the_checkpoint_and_the_config() -> None:
    embed = load_pretrained(str(FIXTURES / EMBED), dtype="float32").hf_model
    chat = load_pretrained(str(FIXTURES / CHAT), dtype="float32").hf_model
    assert sentence_transformers_pooling(embed) == ("last", True)
    assert sentence_transformers_pooling(chat) is None
    declared = Pooling("last", True, "sentence-transformers config")
    assert resolve_pooling(embed, EngineConfig()) == ("embed", declared)
    assert resolve_pooling(chat, EngineConfig()) == ("generate", Pooling())
    assert resolve_pooling(embed, EngineConfig(task="generate", pooling="mean")) == (
        "generate",
        Pooling("mean", True, "config"),
    )
    with pytest.raises(ValueError, match="pooling"):
        EngineConfig(pooling="max")
    with pytest.raises(ValueError, match="task"):
        EngineConfig(task="rerank-ish")


def test_embeddings_match_transformers_and_the_openai_client(server: RunningServer) -> None:
    api = client(server)
    # the openai client asks for base64 and decodes it; floats when asked for them
    out = api.embeddings.create(model=EMBED, input=TEXTS)
    floats = api.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    got, oracle = vectors(out), reference(EMBED, TEXTS, "last", True)
    assert torch.equal(got, vectors(floats))
    assert got.shape == (len(TEXTS), bf.HIDDEN_SIZE)
    assert F.cosine_similarity(got, oracle).min() >= 0.9999
    assert (got - oracle).abs().max() < 1e-5
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)))
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / EMBED)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert all(i[-1] == tokenizer.convert_tokens_to_ids(bf.PAD_TOKEN) for i in ids)  # EOS pooled
    total = sum(len(i) for i in ids)
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (total, total)
    assert out.model == EMBED
    # token ids, one input or several, are the same inputs
    assert torch.equal(vectors(api.embeddings.create(model=EMBED, input=ids)), got)
    one = api.embeddings.create(model=EMBED, input=ids[0])
    assert torch.equal(vectors(one)[0], got[0])
    single = api.embeddings.create(model=EMBED, input=TEXTS[2])
    assert torch.equal(vectors(single)[0], got[2])
    # dimensions: the leading components, normalized again
    short = vectors(api.embeddings.create(model=EMBED, input=TEXTS, dimensions=16))
    assert torch.allclose(short, F.normalize(got[:, :16], dim=1), atol=1e-6)


def test_a_chat_model_embeds_with_its_configured_pooling(server: RunningServer) -> None:
    api = client(server)
    last = vectors(api.embeddings.create(model=CHAT, input=TEXTS))
    assert (last - reference(CHAT, TEXTS, "last", True)).abs().max() < 1e-5
    mean = vectors(api.embeddings.create(model=MEAN, input=TEXTS))
    assert (mean - reference(CHAT, TEXTS, "mean", False)).abs().max() < 1e-5
    # the chat model still chats; the embedding model refuses to, naming its task
    chat = api.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert info.value.body["param"] == "model" and "embed" in info.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=EMBED, prompt="hi", max_tokens=2)
    cards = {m.id: m.model_extra for m in api.models.list().data}
    assert cards[EMBED]["task"] == "embed" and cards[CHAT]["task"] == "generate"
    assert cards[EMBED]["pooling"] == {"mode": "last", "normalize": True, "dimensions": 64}
    assert cards[MEAN]["pooling"]["mode"] == "mean"


@pytest.mark.anyio
async def test_an_inputs_vector_is_the_same_alone_or_batched(server: RunningServer) -> None:
    """Every text alone, then all of them in one request, then in concurrent requests of
    several each beside other inputs of other lengths: the same vector, byte for byte."""
    api = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    alone = [vectors(await api.embeddings.create(model=EMBED, input=t))[0] for t in TEXTS]
    together = vectors(await api.embeddings.create(model=EMBED, input=TEXTS))
    fillers = [" ".join(["station"] * k) for k in (3, 9, 17, 30)]
    results: dict[int, torch.Tensor] = {}
    async with anyio.create_task_group() as tg:
        for k in range(8):
            batch = [TEXTS[k % len(TEXTS)], *fillers[: k % 4 + 1]]

            async def one(k: int = k, batch: list[str] = batch) -> None:
                out = await api.embeddings.create(model=EMBED, input=batch)
                results[k] = vectors(out)[0]

            tg.start_soon(one)
    for i, vector in enumerate(alone):
        assert torch.equal(together[i], vector), i
    for k, vector in results.items():
        assert torch.equal(vector, alone[k % len(TEXTS)]), k
    await api.close()


def test_inputs_are_pooled_many_per_job(server: RunningServer) -> None:
    """One request's inputs go in as few jobs as the token budget (prefill_chunk) allows,
    packed in order: 20 inputs of n tokens, 64 // n of them to a 64-token job."""
    engine = server.state.models[EMBED].engine
    assert engine is not None
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / EMBED)
    ids = tokenizer("The quick brown fox")["input_ids"]
    assert CHUNK // len(ids) >= 2
    before = engine.embedder.jobs
    client(server).embeddings.create(model=EMBED, input=[ids] * 20)
    assert engine.embedder.jobs - before == math.ceil(20 / (CHUNK // len(ids)))


def test_langchains_openai_embeddings_work_unmodified(server: RunningServer) -> None:
    """LangChain's OpenAIEmbeddings, as RAG stacks use it: the same vectors as the API's.
    check_embedding_ctx_length=False makes it send the texts (by default it tokenizes them
    with tiktoken's OpenAI encodings, which it downloads, into ids of another vocabulary)."""
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(
        model=EMBED,
        base_url=server.v1,
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = torch.tensor(embedder.embed_documents(TEXTS))
    query = torch.tensor(embedder.embed_query(TEXTS[0]))
    expected = vectors(client(server).embeddings.create(model=EMBED, input=TEXTS))
    assert torch.equal(documents, expected)
    assert torch.equal(query, expected[0])


def test_litellm_embeds_through_the_server(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LiteLLM, as a proxy or an app calls an OpenAI-compatible server: the same vectors."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (it would fetch it)
    import litellm

    out = litellm.embedding(
        model=f"openai/{EMBED}", input=TEXTS, api_base=server.v1, api_key="unused"
    )
    got = torch.tensor([d["embedding"] for d in out.data])
    expected = vectors(client(server).embeddings.create(model=EMBED, input=TEXTS))
    assert torch.equal(got, expected)
    assert out.usage.prompt_tokens > 0


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_score_is_the_cosine_of_the_embeddings(server: RunningServer) -> None:
    api = client(server)
    embedded = vectors(api.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float"))
    # one text against each of a list
    out = post(server, "/v1/score", {"model": EMBED, "text_1": TEXTS[0], "text_2": TEXTS})
    assert out.status_code == 200, out.text
    body = out.json()
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    got = torch.tensor([d["score"] for d in body["data"]])
    assert torch.allclose(got, embedded @ embedded[0], atol=1e-6)
    assert got[0] == pytest.approx(1.0, abs=1e-6)
    assert body["usage"]["prompt_tokens"] > 0 and body["model"] == EMBED
    # two lists, pair by pair
    pairs = post(server, "/v1/score", {"model": EMBED, "text_1": TEXTS[:2], "text_2": TEXTS[2:4]})
    got = torch.tensor([d["score"] for d in pairs.json()["data"]])
    expected = (embedded[:2] * embedded[2:4]).sum(-1)
    assert torch.allclose(got, expected, atol=1e-6)


def test_rerank_orders_the_documents_by_relevance(server: RunningServer) -> None:
    documents = TEXTS[1:]
    query = TEXTS[0]
    embedded = vectors(client(server).embeddings.create(model=EMBED, input=[query, *documents]))
    relevance = (embedded[1:] @ embedded[0]).tolist()
    expected = sorted(range(len(documents)), key=lambda i: -relevance[i])
    for path in ("/v1/rerank", "/rerank"):
        out = post(server, path, {"model": EMBED, "query": query, "documents": documents})
        assert out.status_code == 200, out.text
        results = out.json()["results"]
        assert [r["index"] for r in results] == expected
        assert [r["document"]["text"] for r in results] == [documents[i] for i in expected]
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        assert scores[0] == pytest.approx(relevance[expected[0]], abs=1e-6)
    # top_n, documents as Cohere's objects, no documents returned
    body = {
        "model": EMBED,
        "query": query,
        "documents": [{"text": d} for d in documents],
        "top_n": 2,
        "return_documents": False,
    }
    results = post(server, "/v1/rerank", body).json()["results"]
    assert [r["index"] for r in results] == expected[:2]
    assert all("document" not in r for r in results)


def reranker_reference(query: str, documents: list[str], instruction: str) -> torch.Tensor:
    """transformers' own forward of the reranker on each prompt alone: P("yes") against
    "no" at its last position, as Qwen3-Reranker's model card computes it."""
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / RERANKER)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / RERANKER, dtype=torch.float32)
    no, yes = (tokenizer.convert_tokens_to_ids(t) for t in ("no", "yes"))
    out = []
    for document in documents:
        text = rerank_prompt(query, document, instruction)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = model.eval()(ids).logits[0, -1]
        out.append(torch.softmax(logits[[no, yes]].float(), dim=-1)[1])
    return torch.stack(out)


def test_a_reranker_scores_yes_against_no_as_transformers_does(server: RunningServer) -> None:
    query, documents = TEXTS[0], TEXTS[1:]
    oracle = reranker_reference(query, documents, RERANK_INSTRUCTION)
    out = post(server, "/v1/rerank", {"model": RERANKER, "query": query, "documents": documents})
    assert out.status_code == 200, out.text
    results = out.json()["results"]
    got = torch.zeros(len(documents))
    for r in results:
        got[r["index"]] = r["relevance_score"]
    assert (got - oracle).abs().max() < 1e-5
    assert [r["index"] for r in results] == sorted(range(len(documents)), key=lambda i: -got[i])
    # the same scores through /v1/score, one document at a time (alone == batched, exactly),
    # and with an instruction of the request's own
    for i, document in enumerate(documents):
        one = post(server, "/v1/score", {"model": RERANKER, "text_1": query, "text_2": document})
        assert one.json()["data"][0]["score"] == got[i].item()
    mine = "Find the sentence that names a year"
    scored = post(
        server,
        "/v1/score",
        {"model": RERANKER, "text_1": query, "text_2": documents, "instruction": mine},
    )
    own = torch.tensor([d["score"] for d in scored.json()["data"]])
    assert (own - reranker_reference(query, documents, mine)).abs().max() < 1e-5
    # a reranker neither embeds nor chats
    for path, body in (
        ("/v1/embeddings", {"model": RERANKER, "input": "x"}),
        (
            "/v1/chat/completions",
            {"model": RERANKER, "messages": [{"role": "user", "content": "x"}]},
        ),
    ):
        refused = post(server, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


SCORE_BAD = [
    ("/v1/score", {"model": CHAT, "text_1": "a", "text_2": "b"}, "model"),
    ("/v1/score", {"model": EMBED, "text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"model": EMBED, "text_1": "a"}, "text_2"),
    ("/v1/score", {"model": EMBED, "text_1": "", "text_2": "b"}, "text_1[0]"),
    ("/v1/rerank", {"model": CHAT, "query": "a", "documents": ["b"]}, "model"),
    ("/v1/rerank", {"model": EMBED, "query": "", "documents": ["b"]}, "query"),
    ("/v1/rerank", {"model": EMBED, "query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"model": EMBED, "query": "a", "documents": "b"}, "documents"),
    ("/v1/rerank", {"model": EMBED, "query": "a", "documents": ["b", 3]}, "documents[1]"),
    ("/v1/rerank", {"model": EMBED, "query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
    (
        "/v1/rerank",
        {"model": EMBED, "query": "a", "documents": ["b"], "return_documents": "yes"},
        "return_documents",
    ),
    (
        "/v1/rerank",
        {"model": RERANKER, "query": "a", "documents": ["b"], "instruction": 3},
        "instruction",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), SCORE_BAD)
def test_bad_score_and_rerank_requests_are_a_400_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


BAD = [
    ({"input": ""}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [["a"]]}, "input[0]"),
    ({"input": ["a", 1]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [[1, 999999]]}, "input[0]"),
    ({"input": [[5] * 600]}, "input[0]"),  # past the context (512)
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_requests_are_a_400_naming_the_field(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    response = httpx.post(f"{server.v1}/embeddings", json={"model": EMBED, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    # and nothing else changed: the next request is served
    ok = httpx.post(f"{server.v1}/embeddings", json={"model": EMBED, "input": "x"}, timeout=60)
    assert ok.status_code == 200


def test_an_unknown_model_is_a_404(server: RunningServer) -> None:
    response = httpx.post(f"{server.v1}/embeddings", json={"model": "nope", "input": "x"})
    assert response.status_code == 404
