"""The config file, command-line overrides, NEURON_BATCHING, and their validation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from neuronpy.cli import build_parser, config_from_args, main
from neuronpy.config import (
    ADMISSION_KEYS,
    ENGINE_KEYS,
    MODEL_KEYS,
    Config,
    EngineConfig,
    ModelSpec,
    ServerConfig,
    load_config,
)
from neuronpy.defaults import REASONING_PARSERS
from neuronpy.engine.reasoning import REASONING_MARKERS

FULL = """
[server]
host = "0.0.0.0"
port = 9000

[model]
path = "tests/fixtures/tiny-llama"
dtype = "bfloat16"
device = "cpu"

[admission]
max_in_flight = 4
max_queue = 10

[engine]
batching = true
prefill_chunk = 256
chunk_steps = 0.5
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "neuronpy.toml"
    path.write_text(text)
    return path


def test_defaults_bind_loopback_and_serve_the_bundled_model() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    (model,) = config.models
    assert model.name is None and model.path is None
    assert model.engine.max_in_flight == 8
    assert model.engine.batching


def test_file_sets_every_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL), environ={})
    assert config.server == ServerConfig("0.0.0.0", 9000)
    engine = EngineConfig(4, 10, prefill_chunk=256)
    assert config.models == (
        ModelSpec(None, "tests/fixtures/tiny-llama", "bfloat16", "cpu", engine=engine),
    )
    assert config.models[0].engine.prefill_chunk == 256
    assert config.models[0].engine.chunk_steps == 0.5


def test_command_line_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    args = build_parser().parse_args(
        [
            "serve",
            "--config",
            str(path),
            "--port",
            "8123",
            "--max-in-flight",
            "2",
            "--dtype",
            "auto",
        ]
    )
    config = config_from_args(args)
    assert config.server == ServerConfig("0.0.0.0", 8123)  # host from the file, port from the flag
    (model,) = config.models
    assert model.engine == EngineConfig(2, 10, prefill_chunk=256)
    assert model.dtype == "auto" and model.device == "cpu"


def test_flags_without_a_file() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m.gguf", "--host", "::1", "--max-queue", "0", "--device", "cuda:1"]
    )
    config = config_from_args(args)
    assert config.models == (
        ModelSpec(path="m.gguf", device="cuda:1", engine=EngineConfig(max_queue=0)),
    )
    assert config.server.host == "::1"


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_neuron_batching_0_forces_one_at_a_time(tmp_path: Path, value: str) -> None:
    config = load_config(write(tmp_path, FULL), environ={"NEURON_BATCHING": value})
    assert config.models[0].engine.batching is False
    assert load_config(environ={"NEURON_BATCHING": "1"}).models[0].engine.batching is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nhots = '1.2.3.4'\n", "unknown key hots in [server]"),
        ("[servers]\nhost = 'x'\n", "unknown section [servers]"),
        ("port = 80\n", "unknown section [port]"),
        ("[server]\nport = 'eighty'\n", "port must be an integer"),
        ("[server]\nport = 70000\n", "port must be between 0 and 65535"),
        ("[server]\nhost = ''\n", "host must be a non-empty string"),
        ("[admission]\nmax_in_flight = 0\n", "max_in_flight must be between 1"),
        ("[admission]\nmax_in_flight = true\n", "max_in_flight must be an integer"),
        ("[admission]\nmax_queue = -1\n", "max_queue must be between 0"),
        ("[model]\ndtype = 'float8'\n", "dtype must be one of"),
        ("[model]\ndevice = 'gpu'\n", "device must be auto, cpu"),
        ("[model]\npath = 3\n", "path must be a non-empty string"),
        ("[engine]\nbatching = 'no'\n", "batching must be true or false"),
        ("[engine]\nchunk_steps = 0\n", "chunk_steps must be a number in"),
        ("[engine]\nchunk_steps = 'fast'\n", "chunk_steps must be a number in"),
        ("[server\n", "not valid TOML"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text), environ={})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config file not found"):
        load_config(tmp_path / "absent.toml", environ={})


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    path = write(tmp_path, "[admission]\nmax_inflight = 4\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "unknown key max_inflight in [admission]" in capsys.readouterr().err


# ---- several models -----------------------------------------------------------------------------

TWO = """
[admission]
max_in_flight = 4
max_queue = 10

[[models]]
name = "llama"
path = "tests/fixtures/tiny-llama"
admission = { max_in_flight = 2 }

[[models]]
name = "qwen"
path = "tests/fixtures/tiny-qwen3"
dtype = "float32"
device = "cpu"

[models.admission]   # this [[models]] entry's own admission
max_queue = 3
"""


def test_models_tables_with_their_own_admission(tmp_path: Path) -> None:
    llama, qwen = load_config(write(tmp_path, TWO), environ={}).models
    assert llama == ModelSpec("llama", "tests/fixtures/tiny-llama", engine=EngineConfig(2, 10))
    assert qwen == ModelSpec(
        "qwen", "tests/fixtures/tiny-qwen3", "float32", "cpu", engine=EngineConfig(4, 3)
    )


def test_repeated_model_flags_name_each_model() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "a=tests/fixtures/tiny-llama", "--model", "org/b=HF/Some-Model"]
    )
    a, b = config_from_args(args).models
    assert (a.name, a.path) == ("a", "tests/fixtures/tiny-llama")
    assert (b.name, b.path) == ("org/b", "HF/Some-Model")
    bare = config_from_args(build_parser().parse_args(["serve", "--model", "dir/x.gguf"]))
    assert bare.models == (ModelSpec(path="dir/x.gguf"),)  # named after the file, as before


def test_model_flags_replace_the_files_models_and_flags_apply_to_every_model(
    tmp_path: Path,
) -> None:
    path = str(write(tmp_path, TWO))
    args = ["serve", "--config", path, "--max-in-flight", "6", "--dtype", "bfloat16"]
    llama, qwen = config_from_args(build_parser().parse_args(args)).models
    assert llama.engine == EngineConfig(6, 10) and llama.dtype == "bfloat16"
    assert qwen.engine == EngineConfig(6, 3) and qwen.dtype == "bfloat16"
    args = ["serve", "--config", path, "--model", "m=tests/fixtures/tiny-mistral"]
    (only,) = config_from_args(build_parser().parse_args(args)).models
    assert only == ModelSpec("m", "tests/fixtures/tiny-mistral", engine=EngineConfig(4, 10))


def test_quantize_per_model_and_from_the_command_line(tmp_path: Path) -> None:
    text = TWO.replace('name = "qwen"', 'name = "qwen"\nquantize = "int8"')
    llama, qwen = load_config(write(tmp_path, text), environ={}).models
    assert (llama.engine.quantize, qwen.engine.quantize) == ("auto", "int8")
    args = build_parser().parse_args(["serve", "--quantize", "int8"])
    assert config_from_args(args).models[0].engine.quantize == "int8"
    with pytest.raises(ValueError, match="quantize must be one of auto, none, int4, "):
        load_config(write(tmp_path, '[model]\nquantize = "int3"\n'), environ={})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["a=x", "a=y"], "model names must be unique; repeated: a"),
        (["x", "y"], "give each one a name"),
        (["a=x", "y"], "give each one a name"),
        (["two words=x"], "a model name must be"),
        (["=x"], "a model name must be"),
        (["-a=x"], "a model name must be"),
        (["a="], "model 'a' path must be a non-empty string"),
    ],
)
def test_bad_model_flags(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["serve", *(f"--model={flag}" for flag in flags)])
    with pytest.raises(ValueError, match=message):
        config_from_args(args)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[models]]\nname = 'a'\n[[models]]\nname = 'a'\n", "repeated: a"),
        ("[[models]]\npath = 'x'\n[[models]]\npath = 'y'\n", "give each one a name"),
        ("[model]\npath = 'x'\n[[models]]\nname = 'a'\n", "not both"),
        ("models = 3\n", "must be an array of tables"),
        ("[[models]]\nname = 'a'\nquantize = 'q4'\n", "model 'a' quantize must be one of"),
        ("[[models]]\nname = 'a'\nquantise = 'int8'\n", "unknown key quantise in model 'a'"),
        ("[[models]]\nname = 'a'\nadmission = 3\n", "model 'a' admission must be a table"),
        (
            "[[models]]\nname = 'a'\n[models.admission]\nmax_queue = -1\n",
            "model 'a': [admission] max_queue must be between 0",
        ),
        ("[[models]]\nname = 'a'\n[models.admission]\nqueue = 1\n", "unknown key queue"),
        ("[[models]]\nname = 'a b'\n", "a model name must be"),
    ],
)
def test_bad_models_tables(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text), environ={})


def test_cli_reports_duplicate_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "a=x", "--model", "a=y"]) == 2
    assert "model names must be unique; repeated: a" in capsys.readouterr().err


def test_kv_budget_takes_bytes_or_sizes_per_model_and_from_the_command_line(
    tmp_path: Path,
) -> None:
    text = TWO.replace('name = "qwen"', 'name = "qwen"\nkv_budget = "512MiB"')
    llama, qwen = load_config(write(tmp_path, text), environ={}).models
    assert (llama.engine.kv_budget, qwen.engine.kv_budget) == (0, 512 * 1024**2)
    for flag, expected in [("2GiB", 2 * 1024**3), ("1.5GB", 1_500_000_000), ("4096", 4096)]:
        args = build_parser().parse_args(["serve", "--kv-budget", flag])
        assert config_from_args(args).models[0].engine.kv_budget == expected
    for bad in ['"lots"', "-1", '"12 parsecs"', "true"]:
        with pytest.raises(ValueError, match="kv_budget must be"):
            load_config(write(tmp_path, f"[model]\nkv_budget = {bad}\n"), environ={})


def test_sessions_dir_from_the_file_and_the_command_line(tmp_path: Path) -> None:
    assert load_config(environ={}).server.sessions_dir is None  # off by default
    config = load_config(write(tmp_path, '[server]\nsessions_dir = "/srv/s"\n'), environ={})
    assert config.server.sessions_dir == "/srv/s"
    args = build_parser().parse_args(["serve", "--sessions-dir", "here"])
    assert config_from_args(args).server.sessions_dir == "here"
    with pytest.raises(ValueError, match="sessions_dir must be a directory path"):
        load_config(write(tmp_path, "[server]\nsessions_dir = 3\n"), environ={})


def test_tensor_parallel_from_the_file_and_the_command_line(tmp_path: Path) -> None:
    assert load_config(environ={}).models[0].tensor_parallel == 1
    config = load_config(write(tmp_path, "[model]\ntensor_parallel = 2\n"), environ={})
    assert config.models[0].tensor_parallel == 2
    args = build_parser().parse_args(["serve", "--tensor-parallel", "3"])
    assert config_from_args(args).models[0].tensor_parallel == 3
    with pytest.raises(ValueError, match="tensor_parallel must be between 1 and 64"):
        load_config(write(tmp_path, "[model]\ntensor_parallel = 0\n"), environ={})
    follower = build_parser().parse_args(["tp-follower", "--model", "/m"])
    assert follower.command == "tp-follower" and follower.model == "/m"


def test_tp_follower_without_its_environment_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["tp-follower"]) == 1
    assert "RANK is not set" in capsys.readouterr().err


# ---- one EngineConfig ----------------------------------------------------------------------------


def test_every_engine_setting_is_written_in_exactly_one_table() -> None:
    keys = [*ADMISSION_KEYS, *ENGINE_KEYS, *MODEL_KEYS]
    assert sorted(keys) == sorted(f.name for f in dataclasses.fields(EngineConfig))
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_in_flight": 4097}, "max_in_flight must be between 1 and 4096, got 4097"),
        ({"max_queue": 1_000_001}, "max_queue must be between 0 and 1000000"),
        ({"max_n": 0}, "max_n must be between 1 and 128"),
        ({"queue_timeout": None}, "queue_timeout must be a number of seconds"),
        ({"chunk_steps": 101}, r"chunk_steps must be a number in \[0.1, 100\]"),
        ({"prefill_chunk": 0}, "prefill_chunk must be at least 1"),
        ({"prefix_cache": 1}, "prefix_cache must be true or false"),
        ({"prefix_cache_bytes": -1}, "prefix_cache_bytes must be at least 0"),
        ({"quantize": "int3"}, "quantize must be one of auto, none, int4, int4-g64"),
        ({"reasoning_parser": "xml"}, "reasoning_parser must be one of auto, none, think"),
        ({"kv_budget": "lots"}, "kv_budget must be a number of bytes"),
    ],
)
def test_engine_config_names_the_bad_field(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**values)  # type: ignore[arg-type]


def test_the_reasoning_parser_names_are_the_parsers() -> None:
    assert ("auto", "none", *REASONING_MARKERS) == REASONING_PARSERS


def test_engine_config_keeps_one_representation_of_each_value() -> None:
    config = EngineConfig(queue_timeout=0, chunk_steps=1, kv_budget="1KiB")
    assert config.queue_timeout == 0.0 and isinstance(config.queue_timeout, float)  # no deadline
    assert isinstance(config.chunk_steps, float)
    assert config.kv_budget == 1024
    assert config == EngineConfig(queue_timeout=0.0, chunk_steps=1.0, kv_budget=1024)


def test_server_wide_errors_name_their_table_and_a_models_own_name_the_model(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"^\[admission\] max_in_flight must be between 1"):
        load_config(
            write(tmp_path, TWO.replace("max_in_flight = 4", "max_in_flight = 0")), environ={}
        )
    with pytest.raises(ValueError, match=r"^\[engine\] prefill_chunk must be at least 1"):
        load_config(write(tmp_path, TWO + "[engine]\nprefill_chunk = 0\n"), environ={})
    bad_own = TWO.replace("max_in_flight = 2 }", "max_in_flight = 0 }")
    with pytest.raises(ValueError, match=r"^model 'llama': \[admission\] max_in_flight must be"):
        load_config(write(tmp_path, bad_own), environ={})
    with pytest.raises(ValueError, match="unknown key batching in model 'a'"):
        load_config(write(tmp_path, "[[models]]\nname = 'a'\nbatching = false\n"), environ={})


def test_reading_a_config_file_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from neuronpy.config import load_config\n"
        f"load_config({str(write(tmp_path, FULL))!r}, environ={{}})\n"
        "heavy = sorted({'torch', 'transformers', 'neuronpy.engine.engine'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
