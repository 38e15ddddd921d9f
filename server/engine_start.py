"""Starting the engine behind the app (in its own process, or on a thread with
--no-engine-process), then what the routes need of the model it loaded: the tokenizer, names,
limits, metrics and parsers. Runs in the app's nursery at start-up: until it is done the server
answers /health with 503 (loading)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any, NamedTuple

import trio
from quart_trio import QuartTrio

from core.config import CheckpointError, EngineConfig, is_bad_input
from core.engine import EngineThread
from core.engine_attached import AttachedEngine
from core.pooling import ModelPooling
from core.engine_process import EngineProcess
from core.lora import LoraError
from core.shared_count import SharedCounts
from core.stats import StepStats
from server import embedding_config, reasoning, tool_parsers
from server.api_server_messages import Seat, adds_file
from server.chat import load_template
from server.logprobs import TokenText
from server.lora import LoraRegistry
from server.metrics import CacheInfo, Memory, Metrics
from server.state import ServerState
from server.stats_log import StatsLog

log = logging.getLogger("weir.server")


def _fail(app: QuartTrio, st: ServerState, reason: str) -> None:
    st.status, st.reason = "failed", reason
    app.weir_failed = reason
    app.weir_shutdown.set()


async def load_engine(app: QuartTrio, st: ServerState) -> None:
    try:
        st.chat_template = load_template(st.config.chat_template)
        if st.options.engine_process:
            # One of several API servers (a seat) shares the engine the supervisor started.
            engine = _attached(st.config, st.seat) if st.seat else EngineProcess(st.config)
            watch = trio.CancelScope()
            if isinstance(engine, EngineProcess):
                app.nursery.start_soon(_stop_loading_on_shutdown, app, engine, watch)
            try:
                try:
                    loaded = await trio.to_thread.run_sync(_launch, engine)
                finally:
                    watch.cancel()
            except BaseException as e:
                stopped = isinstance(e, Exception) and app.weir_shutdown.is_set()
                if stopped and not app.weir_failed:
                    log.info("stopped while the model was loading")
                await engine.shutdown()  # no child may outlive a failed start
                if stopped and not app.weir_failed:
                    return
                raise
        else:
            loaded = await trio.to_thread.run_sync(_load, st.config)
            engine = EngineThread(loaded.core)
            loaded = _Loaded(
                loaded.tokenizer,
                loaded.served_names,
                loaded.max_model_len,
                loaded.generation_defaults,
                loaded.core.kv.num_blocks,
                loaded.kv_dtype,
                loaded.core.runner.vocab_size,
                str(loaded.model_path),
                loaded.weight_bytes or {},
                loaded.kv_cache_bytes,
                loaded.lora_base,
                loaded.labels,
                loaded.score_template,
                loaded.pooling,
            )
        facts = st.pooling_facts = loaded.pooling
        st.encoder = facts is not None and facts.encoder
        if facts is not None:
            st.activations = (facts.classify_activation, facts.score_activation)
        if st.encoder and loaded.labels is None:  # an encoder embeds, and only embeds
            if "generate" in st.tasks:
                log.info("the model is an encoder: it serves embeddings, not generation")
            st.tasks = ("embed",)
            if facts.m3_specials is not None:  # (BGE-M3: its sparse weights too)
                st.tasks = ("embed", "token_classify")
        if loaded.labels is not None:  # a sequence classifier: classify and score, nothing else
            if "generate" in st.tasks and "embed" in st.tasks:  # --enable-embeddings
                await engine.shutdown()
                raise CheckpointError(
                    "a sequence-classification checkpoint serves /classify, /score and /rerank; "
                    "it cannot also serve embeddings (--enable-embeddings)"
                )
            st.tasks, st.labels = ("classify", "score"), loaded.labels
            if facts is not None and facts.per_token:  # a token classifier: /pooling's task
                st.tasks = ("token_classify",)
            st.score_template = loaded.score_template
        lora = None
        if st.config.enable_lora:  # --lora-modules, checked before anything is served
            lora = LoraRegistry(loaded.lora_base, st.config.max_lora_rank)
            try:
                lora.load_modules(st.config.lora_modules)
            except (LoraError, ValueError) as e:
                await engine.shutdown()
                raise CheckpointError(f"--lora-modules: {e}") from None
        cache = CacheInfo(
            st.config.block_size,
            loaded.num_blocks,
            st.config.enable_prefix_caching,
            loaded.kv_dtype,
            st.config.gpu_memory_utilization,
            loaded.num_blocks * st.config.block_size,
            loaded.num_blocks * st.config.block_size / loaded.max_model_len,
        )
        metrics = Metrics(
            st.options.metrics_prefix,
            loaded.served_names[0],
            loaded.max_model_len,
            cache,
            Memory(loaded.weight_bytes, loaded.kv_cache_bytes, loaded.kv_dtype),
            multiprocess=st.seat is not None,
            max_loras=st.config.max_loras if st.config.enable_lora else None,
        )
        # Of several API servers, one publishes the engine's statistics (core/engine_fanout.py).
        publishes = st.seat is None or st.seat.publishes_engine_stats
        engine.on_stats = metrics.publish if publishes else None
        metrics.clear_gauges()
        stats_log = None
        if st.options.log_stats and publishes:
            stats_log = StatsLog()

            def on_stats(s: StepStats) -> None:
                metrics.publish(s)
                stats_log.observe(s)

            engine.on_stats = on_stats
            app.nursery.start_soon(stats_log.run, st.options.stats_interval)

        def died(message: str) -> None:
            log.error("%s", message)
            metrics.clear_gauges()  # nothing runs or waits any more
            if stats_log is not None:
                stats_log.observe(StepStats())
            if st.options.exit_on_engine_error:
                # In-flight requests already got the error; exit so the orchestrator restarts us.
                _fail(app, st, message)
            else:  # up, unhealthy, until stopped: then exit 1, not 0 (it did not end well)
                app.weir_failed = message

        engine.on_death = died
        engine.start()
    except CheckpointError as e:  # the model given: exit code 2, as for any bad argument
        log.error("could not load the model: %s", e)
        app.weir_bad_input = True
        _fail(app, st, str(e) if str(e).startswith("loading failed") else f"loading failed: {e}")
        return
    except Exception as e:  # noqa: BLE001 - reported, and the server shuts itself down
        if is_bad_input(e):  # the model's files or the flags against them: one line, exit 2
            log.error("could not load the model: %s: %s", type(e).__name__, e)
            app.weir_bad_input = True
        else:
            log.exception("could not load the model")
        _fail(app, st, f"loading failed: {type(e).__name__}: {e}")
        return
    st.engine = engine
    st.metrics = metrics
    st.lora = lora
    st.tokenizer = loaded.tokenizer
    st.served_names = loaded.served_names
    st.max_model_len = loaded.max_model_len
    st.generation_defaults = loaded.generation_defaults
    st.token_text = TokenText(loaded.tokenizer)
    st.special_ids = {
        t.content: i for i, t in loaded.tokenizer.added_tokens_decoder.items() if t.special
    }
    st.vocab_size = loaded.vocab_size
    if "embed" in st.tasks:
        try:
            st.embedding = embedding_config.resolve(
                Path(loaded.model_path), st.options.pooling, st.options.normalize, loaded.pooling
            )
        except ValueError as e:  # (its pooling files ask for what weir does not do)
            log.error("could not load the model: %s", e)
            app.weir_bad_input = True
            _fail(app, st, f"loading failed: {e}")
            return
        log.info(
            "embeddings: %s pooling%s", st.embedding.kind, ", normalized" * st.embedding.normalize
        )
    template = st.chat_template or getattr(loaded.tokenizer, "chat_template", None)
    st.reasoning_parser = reasoning.resolve(st.options.reasoning_parser, template)
    st.tool_parser = tool_parsers.resolve(st.options.tool_call_parser, template)
    if st.tool_parser is not None:
        log.info("tool-call parser: %s", st.tool_parser)
    if st.options.reasoning_parser is not None:
        log.info(
            "reasoning parser: %s", st.reasoning_parser or "none (the template has no <think>)"
        )
    # What start-up made (torch, transformers, the model, the tokenizer) lives as long as the
    # process: out of the collector's reach, a full collection while serving walks only what
    # serving made (a full collection of start-up's objects stalled every stream: figures in
    # docs/benchmarks.md).
    gc.freeze()
    if st.status == "loading":
        st.status, st.reason = "ready", "ok"
    log.info("serving %s", ", ".join(st.served_names))


async def _stop_loading_on_shutdown(
    app: QuartTrio, engine: EngineProcess, watch: trio.CancelScope
) -> None:
    """A signal while the model loads (until `watch` is cancelled): the engine process is killed
    (it serves nothing yet, and loading an 8B model can outlast an orchestrator's grace period),
    so the server exits now."""
    with watch:
        await app.weir_shutdown.wait()
        engine.kill_loading()


def _attached(config: EngineConfig, seat: Seat) -> AttachedEngine:
    counts = SharedCounts(adds_file(seat.run_dir), seat.count, seat.index)
    return AttachedEngine(config, *seat.engine_fds, adds=counts)


def _load(config: EngineConfig):
    from gpu import openmp

    openmp.prepare(config)  # before torch is imported (gpu/openmp.py)
    from gpu.launch import load  # the only place the server reaches into gpu/

    return load(config)


class _Loaded(NamedTuple):
    """What the server needs of a model the engine process loaded."""

    tokenizer: Any
    served_names: list[str]
    max_model_len: int
    generation_defaults: dict[str, Any]
    num_blocks: int
    kv_dtype: str
    vocab_size: int
    model_path: str
    weight_bytes: dict[str, int]
    kv_cache_bytes: int
    lora_base: Any = None  # core/lora.py LoraBase, with --enable-lora
    labels: list[str] | None = None  # a sequence classifier's (None: a causal LM)
    score_template: str | None = None  # a reranker's prompt for its pairs (core/score_pairs.py)
    pooling: ModelPooling | None = None  # the model's own pooling facts (a GGUF file's kind)


def _launch(engine: EngineProcess | AttachedEngine) -> _Loaded:
    """Start the engine process (or, one of several API servers, find the supervisor's), wait
    for its model, then load the tokenizer from the same (already resolved or downloaded)
    directory for chat templates and prompts."""
    from transformers import AutoTokenizer

    info = engine.launch()
    return _Loaded(
        AutoTokenizer.from_pretrained(
            info.tokenizer_path or info.model_path, trust_remote_code=False
        ),
        info.served_names,
        info.max_model_len,
        info.generation_defaults,
        info.num_blocks,
        info.kv_dtype,
        info.vocab_size,
        info.model_path,
        info.weight_bytes,
        info.kv_cache_bytes,
        info.lora_base,
        info.labels,
        info.score_template,
        info.pooling,
    )
