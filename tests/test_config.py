"""The config file, command-line overrides, NEURON_BATCHING, and their validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuronpy.cli import build_parser, config_from_args, main
from neuronpy.config import (
    AdmissionConfig,
    Config,
    ModelSpec,
    ServerConfig,
    load_config,
)

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
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "neuronpy.toml"
    path.write_text(text)
    return path


def test_defaults_bind_loopback_and_serve_the_bundled_model() -> None:
    config = load_config(environ={})
    assert config == Config()
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.model.path is None
    assert config.admission.max_in_flight == 8
    assert config.engine.batching


def test_file_sets_every_section(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL), environ={})
    assert config.server == ServerConfig("0.0.0.0", 9000)
    assert config.model == ModelSpec("tests/fixtures/tiny-llama", "bfloat16", "cpu")
    assert config.admission == AdmissionConfig(4, 10)
    assert config.engine.prefill_chunk == 256


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
    assert config.admission == AdmissionConfig(2, 10)
    assert config.model.dtype == "auto" and config.model.device == "cpu"


def test_flags_without_a_file() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m.gguf", "--host", "::1", "--max-queue", "0", "--device", "cuda:1"]
    )
    config = config_from_args(args)
    assert config.model.path == "m.gguf" and config.model.device == "cuda:1"
    assert config.server.host == "::1" and config.admission.max_queue == 0


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_neuron_batching_0_forces_one_at_a_time(tmp_path: Path, value: str) -> None:
    config = load_config(write(tmp_path, FULL), environ={"NEURON_BATCHING": value})
    assert config.engine.batching is False
    assert load_config(environ={"NEURON_BATCHING": "1"}).engine.batching is True


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
