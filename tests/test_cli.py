"""The `weir serve` command end to end: the built-in tiny model, flags, and a failed start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from core.config import EngineConfig
from server.cli import build_parser, config_from_args, main
from tests.conftest import free_port, http_status, wait_for


def test_flags_map_to_engine_config():
    args = build_parser().parse_args(
        [
            "serve",
            "some/model",
            "--port",
            "9000",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "128",
            "--num-kv-blocks",
            "99",
            "--dtype",
            "bfloat16",
            "--served-model-name",
            "a",
            "b",
        ]
    )
    config = config_from_args(args)
    assert args.port == 9000
    assert config.model == "some/model" and config.served_model_name == ["a", "b"]
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.num_kv_blocks) == (
        4,
        128,
        99,
    )
    assert config.dtype == "bfloat16"
    assert config.enable_prefix_caching and config.scheduling_policy == "fcfs"
    off = config_from_args(
        build_parser().parse_args(
            ["serve", "--no-enable-prefix-caching", "--scheduling-policy", "priority"]
        )
    )
    assert not off.enable_prefix_caching and off.scheduling_policy == "priority"
    assert config_from_args(build_parser().parse_args(["serve"])).model is None
    lora = config_from_args(
        build_parser().parse_args(["serve", "--enable-lora", "--lora-dtype", "bfloat16"])
    )
    assert lora.enable_lora and lora.lora_dtype == "bfloat16"
    assert config_from_args(build_parser().parse_args(["serve"])).lora_dtype == "auto"


def test_the_kv_cache_memory_default_follows_vllms_cpu_variable(monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE (GiB, vLLM's CPU backend's) sets --kv-cache-memory's default in
    every process that reads the config (this suite's conftest sets it to 0.125)."""
    from core.config import DEFAULT_KV_CACHE_MEMORY, _kv_cache_space

    assert EngineConfig().kv_cache_memory == DEFAULT_KV_CACHE_MEMORY == 1 << 27
    assert config_from_args(build_parser().parse_args(["serve"])).kv_cache_memory == 1 << 27
    for raw, want in (("4", 4 << 30), ("0.5", 1 << 29), ("0", 1 << 30), ("", 1 << 30)):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", raw)
        assert _kv_cache_space() == want
    for bad in ("lots", "-1"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
            _kv_cache_space()


def test_cpu_threads_auto_follows_the_model_size():
    from types import SimpleNamespace

    from gpu.assemble import auto_threads

    def threads(*flags):
        return config_from_args(build_parser().parse_args(["serve", *flags])).cpu_threads

    assert threads() == 0  # auto: decided when the model is loaded
    assert threads("--cpu-threads", "3") == 3
    for bad in ("0", "many"):  # a ValueError: main's one line and exit 2
        with pytest.raises(ValueError, match="--cpu-threads"):
            threads("--cpu-threads", bad)
    assert main(["serve", "--cpu-threads", "0"]) == 2
    with pytest.raises(SystemExit) as e:  # argparse's: exit 2, one line
        build_parser().parse_args(["serve", "--port", "99999"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="cpu-threads"):
        EngineConfig(cpu_threads=-1).validate()
    cores = len(os.sched_getaffinity(0))

    def shape(hidden, layers, mlp, heads=8, kv=2):
        return SimpleNamespace(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            num_hidden_layers=layers,
            intermediate_size=mlp,
        )

    # A small model leaves a core to the HTTP event loop; a 6-layer, 17M one takes them all.
    assert auto_threads(shape(128, 3, 384, heads=4)) == max(1, cores - 1)
    assert auto_threads(shape(512, 6, 1408)) == cores


def test_engine_runs_in_its_own_process_unless_told_otherwise():
    from server.cli import options_from_args

    def engine_process(*flags):
        return options_from_args(build_parser().parse_args(["serve", *flags])).engine_process

    assert engine_process() is True
    assert engine_process("--no-engine-process") is False
    assert engine_process("--engine-process") is True


def test_core_never_imports_torch():
    code = (
        "import sys, core.engine, core.engine_core, core.engine_process, core.scheduler, "
        "core.detokenizer, core.outputs, core.config; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_builtin_tiny_model_with_openai_sdk(tmp_path):
    """`weir serve` with no model builds the built-in tiny model into an empty cache and
    serves it. The compiled kernels come from the usual cache (what this test is about is the
    model; compiling them again here took most of a busy machine's two minutes)."""
    from gpu.cache import cache_dir

    port = free_port()
    (tmp_path / "cache").mkdir()
    (cache_dir() / "kernels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache" / "kernels").symlink_to(cache_dir() / "kernels")
    env = dict(os.environ, WEIR_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port), "--num-kv-blocks", "256"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # ready or dead: the wait ends on either, and its bound is only for a hang
        assert wait_for(
            lambda: proc.poll() is not None or http_status(url + "/health") == 200, timeout=600
        )
        assert proc.poll() is None, proc.stdout.read().decode()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["weir-tiny"]
        stream = client.chat.completions.create(
            model="weir-tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            stream=True,
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        client.close()
        assert (tmp_path / "cache" / "weir-tiny-v1" / "config.json").exists()
        # the HTTP process runs no model: torch stays out of it (transformers' tokenizers would
        # pull it in, ~200 MB resident), while the engine process has it
        maps = Path(f"/proc/{proc.pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text()
    finally:
        proc.send_signal(2)  # SIGINT: a clean shutdown
        code = proc.wait(60)
    assert code == 0


def test_unloadable_model_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            str(tmp_path / "missing"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2  # the model given is bad input, as a bad flag is
    assert "does not exist" in proc.stderr


@pytest.mark.parametrize("count", [1, 2])
def test_a_port_in_use_is_one_line_and_exit_code_1(tmp_path, count):
    """Bound before the model loads: an operator sees why, not a traceback, and nothing starts."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "server",
                "serve",
                str(tmp_path / "never-loaded"),
                "--port",
                str(port),
                "--api-server-count",
                str(count),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        taken.close()
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"weir: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize(
    "template,message",
    [
        ("/no/such/template.jinja", "is neither a file nor a template"),
        ("{% if %}hi", "not a valid template (line 1: Expected an expression"),
    ],
)
def test_a_bad_chat_template_is_refused_at_start(template, message):
    """Before any model loads (exit 2, as any bad flag), not as a 400 on every chat request."""
    proc = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--chat-template", template],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr


def test_templates_transformers_renders_pass_the_start_up_check():
    from gpu.tiny_tokenizer import CHATML
    from server.chat import check_template, load_template

    check_template(CHATML)
    # a template given inline, longer than a file name may be (it had failed the model's load:
    # "File name too long", where is_file raises), is the template
    long = "{{ bos_token }}" + "{# a comment #}" * 40 + "{{ messages[0].content }}"
    assert load_template(long) == long
    check_template(  # assistant-mask blocks and loop controls
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
