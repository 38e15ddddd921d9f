"""Prometheus metrics with vLLM's names, types and meanings (prefix `weir:` or, with
`--metrics-prefix vllm`, `vllm:` so existing dashboards work unchanged). Fed once per engine step
on the Trio thread from the engine's StepStats.

With several API servers (--api-server-count N > 1) prometheus_client runs in its multiprocess
mode: every server writes its values to files in PROMETHEUS_MULTIPROC_DIR (the supervisor's
run directory) and /metrics, from any server, reads them all: counters and histograms summed
over the servers. The engine's own statistics reach one server only (core/engine_fanout.py), so
they are counted once; its gauges are that server's latest values (`livemostrecent`: dropped if
it dies), the constant gauges (cache_config_info, weights, KV bytes) the same in every server
(`mostrecent`)."""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.stats import StepStats

LATENCY_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
REQUEST_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]


def token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (as vLLM builds them)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            v = m * base
            if v > max_len:
                return [float(x) for x in out]
            out.append(v)
        base *= 10


PREEMPTION_BUCKETS = [0, 1, 2, 3, 4, 5, 10, 20]
N_BUCKETS = [1, 2, 5, 10, 20]


class CacheInfo(NamedTuple):
    """cache_config_info's labels (vLLM names them after its CacheConfig fields)."""

    block_size: int
    num_gpu_blocks: int  # KV blocks, on whichever device the model runs
    enable_prefix_caching: bool
    cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_size_tokens: int  # tokens the KV cache holds: blocks x block size
    kv_cache_max_concurrency: float  # full-length requests that fit: tokens / max_model_len


class Memory(NamedTuple):
    """What the model holds in memory: its weights' bytes by format, the KV cache's."""

    weight_bytes: dict[str, int]
    kv_cache_bytes: int
    kv_dtype: str


class Metrics:
    def __init__(
        self,
        prefix: str,
        model_name: str,
        max_model_len: int,
        cache: CacheInfo | None = None,
        memory: Memory | None = None,
        multiprocess: bool = False,
        max_loras: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess  # render every API server's files (see above)
        p = f"{prefix}:"
        labels = ["model_name"]
        reg = self.registry

        def gauge(name, doc):
            return Gauge(
                p + name, doc, labels, registry=reg, multiprocess_mode="livemostrecent"
            ).labels(model_name)

        def counter(name, doc):
            return Counter(p + name, doc, labels, registry=reg).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(p + name, doc, labels, buckets=buckets, registry=reg).labels(
                model_name
            )

        tokens = token_buckets(max_model_len)
        self.running = gauge("num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be processed.")
        by_reason = Gauge(
            p + "num_requests_waiting_by_reason",
            "Requests waiting, by why: capacity (no room in the batch or the KV cache yet) or "
            "deferred (held for another reason: a further sample of a prompt waits for the "
            "first sample's prompt to be cached).",
            labels + ["reason"],
            registry=reg,
            multiprocess_mode="livemostrecent",
        )
        self.waiting_capacity = by_reason.labels(model_name, "capacity")
        self.waiting_deferred = by_reason.labels(model_name, "deferred")
        # LoRA (--enable-lora): vLLM's lora_requests_info (the labels say which adapters the
        # running and the waiting requests use; the value is when that was last seen), and
        # finished requests per adapter.
        self.max_loras = max_loras
        self._lora_labels: tuple[str, str] | None = None
        if max_loras is not None:
            self.lora_info = Gauge(
                p + "lora_requests_info",
                "Running stats on LoRA requests: the adapters of the running and of the "
                "waiting requests (comma-separated names), and --max-loras.",
                ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                registry=reg,
                multiprocess_mode="livemostrecent",  # one publisher: no pid label
            )
            self.lora_requests = Counter(
                p + "lora_requests",
                "Finished requests per LoRA adapter.",
                labels + ["lora_name"],
                registry=reg,
            )
        self._rejections = counter(
            "admission_rejections",
            "Requests refused at admission because --max-waiting-requests were already waiting.",
        )
        if cache is not None:
            info = Gauge(
                p + "cache_config_info",
                "Information of the cache config (labels; the value is 1).",
                list(CacheInfo._fields),
                registry=reg,
                multiprocess_mode="mostrecent",
            )
            info.labels(*(str(v) for v in cache)).set(1)
        if memory is not None and memory.weight_bytes:
            weights = Gauge(
                p + "model_weights_bytes",
                "Bytes of model weights held in memory, by format (f32, bf16, q4_k, ...).",
                labels + ["format"],
                registry=reg,
                multiprocess_mode="mostrecent",
            )
            for fmt, n in memory.weight_bytes.items():
                weights.labels(model_name, fmt).set(n)
            Gauge(
                p + "kv_cache_bytes",
                "Bytes of the KV cache (K and V, every layer).",
                labels + ["dtype"],
                registry=reg,
                multiprocess_mode="mostrecent",
            ).labels(model_name, memory.kv_dtype).set(memory.kv_cache_bytes)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        # speculative decoding, as vLLM counts it (zero without --speculative-config)
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._spec_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels + ["position"],
            registry=reg,
        )
        self._success = Counter(
            p + "request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.model_name = model_name
        self.ttft = hist(
            "time_to_first_token_seconds", "Histogram of time to first token.", LATENCY_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Histogram of inter-token latency.", ITL_BUCKETS
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Histogram of end to end request latency.",
            REQUEST_BUCKETS,
        )
        self.queue = hist(
            "request_queue_time_seconds", "Time spent in the WAITING phase.", REQUEST_BUCKETS
        )
        self.prefill = hist(
            "request_prefill_time_seconds", "Time spent in the PREFILL phase.", REQUEST_BUCKETS
        )
        self.decode = hist(
            "request_decode_time_seconds", "Time spent in the DECODE phase.", REQUEST_BUCKETS
        )
        self.req_prompt = hist(
            "request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.req_generation = hist(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.inference = hist(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.req_preemptions = hist(
            "request_num_preemptions",
            "Histogram of the number of preemptions per finished request.",
            PREEMPTION_BUCKETS,
        )
        self.iteration = hist(
            "iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )

    def clear_gauges(self) -> None:
        """The engine's gauges at zero: at start (with several API servers they would be absent
        until the first step, and alerts on them would see no data) and once the engine is gone
        (they had kept its last values)."""
        for g in (self.running, self.waiting, self.waiting_capacity, self.waiting_deferred):
            g.set(0)
        self.kv_usage.set(0)

    def publish(self, s: StepStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.waiting_capacity.set(s.num_waiting - s.num_deferred)
        self.waiting_deferred.set(s.num_deferred)
        self.kv_usage.set(s.kv_usage)
        if self.max_loras is not None and s.lora_running is not None:
            self._publish_lora(s)
        for counter, value in (
            (self.prompt_tokens, s.prompt_tokens),
            (self.generation_tokens, s.generation_tokens),
            (self.preemptions, s.preemptions),
            (self.prefix_queries, s.prefix_queries),
            (self.prefix_hits, s.prefix_hits),
            (self.spec_drafts, s.spec_drafts),
            (self.spec_draft_tokens, s.spec_draft_tokens),
            (self.spec_accepted, s.spec_accepted_tokens),
        ):
            if value:
                counter.inc(value)
        for pos, value in enumerate(s.spec_accepted_per_pos):
            if value:
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(value)
        for v in s.iteration_tokens:
            self.iteration.observe(v)
        for v in s.ttft:
            self.ttft.observe(v)
        for v in s.itl:
            self.itl.observe(v)
        for f in s.finished:
            self._success.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e)
            self.queue.observe(f.queue)
            self.prefill.observe(f.prefill)
            self.decode.observe(f.decode)
            self.req_prompt.observe(f.prompt_tokens)
            self.req_generation.observe(f.generation_tokens)
            self.inference.observe(f.inference)
            self.params_max_tokens.observe(f.max_tokens)
            self.req_preemptions.observe(f.num_preemptions)
            if f.lora_name is not None and self.max_loras is not None:
                self.lora_requests.labels(self.model_name, f.lora_name).inc()

    def _publish_lora(self, s: StepStats) -> None:
        labels = (",".join(s.lora_running), ",".join(s.lora_waiting))
        if labels != self._lora_labels:  # one series at a time: the current adapters
            if self._lora_labels is not None:
                old = (*self._lora_labels, str(self.max_loras))
                if self.multiprocess:  # prometheus_client cannot remove a series there: 0
                    self.lora_info.labels(*old).set(0)
                else:
                    self.lora_info.remove(*old)
            self._lora_labels = labels
        self.lora_info.labels(*labels, str(self.max_loras)).set_to_current_time()

    def admission_rejected(self) -> None:
        self._rejections.inc()

    def request_params_n(self, n: int, prompts: int = 1) -> None:
        """Once per prompt of a finished HTTP request (vLLM counts each prompt as a request)."""
        for _ in range(prompts):
            self.params_n.observe(n)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (body, content type) the scraper's Accept header asks for: Prometheus
        text, or OpenMetrics (as prometheus_client's own HTTP handler negotiates it)."""
        from prometheus_client.exposition import choose_encoder

        encode, content_type = choose_encoder(accept)
        if not self.multiprocess:
            return encode(self.registry), content_type
        from prometheus_client import multiprocess

        every_server = CollectorRegistry()
        multiprocess.MultiProcessCollector(every_server)
        return encode(every_server), content_type
