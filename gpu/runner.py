"""ModelRunner: a step (core/runner_step.py) -> flat tensors -> one forward pass -> sampled ids.

The runner keeps its own copy of its requests (gpu/runner_state.py), updated from each step's
SchedulerOutput; the same runner runs in the engine's process and on every tensor-parallel rank.

`submit` queues a step's work on the device and returns at once (a `LaunchedStep`); its
`result()` waits for the sampled ids. Between the two the engine can schedule and launch the
next step (asynchronous scheduling): a row whose input is this step's sample (`pending`) reads it
from `_last_sampled` on the device, with no trip through the host. `execute` is both at once.
"""

from __future__ import annotations

from array import array
from concurrent.futures import ThreadPoolExecutor

import torch

from core.beam import num_candidates, stop_ids
from core.request import Logprob, StepResult
from core.runner_step import GrammarBatch, SchedulerOutput
from core.sampling import banned_by_bad_words
from gpu import grammar_mask
from gpu.attention.backend import AttentionMetadata
from gpu.cuda.graphs import replay_or_run
from gpu.models.decoder import DecoderForCausalLM
from gpu.launched_step import LaunchedStep
from gpu.models.encoder_spec import PER_TOKEN_HEADS
from gpu.pooler import pool
from gpu.runner_state import RunnerRequest, RunnerRequests
from gpu.sampler import Sampler, SamplingMetadata


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        seed: int = 0,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.spec.vocab_size
        self.num_labels = model.spec.num_labels  # a sequence classifier's (0: a causal LM)
        self.pooling_only = model.pooling_only  # an encoder: it embeds and classifies alone
        self.per_token = getattr(model.spec, "head", "") in PER_TOKEN_HEADS  # token classifier
        self.projector = None  # sentence-transformers' Dense modules (gpu/st_dense.py)
        self.sampler = Sampler(seed, device, model.backend, logprobs_mode)
        self.eos_token_ids: set[int] = set()  # banned before a request's min_tokens
        self.last_logits: torch.Tensor | None = None  # kept for tests that compare logits
        self.graphs = None  # DecodeGraphs when decode steps replay CUDA graphs (see launch)
        self.verify_graphs = None  # VerifyGraphs, with speculative decoding as well
        self._mask_pool: ThreadPoolExecutor | None = None
        # False on tensor-parallel ranks other than 0: they run the forward (and its
        # collectives) but leave sampling, pooling and the grammar masks to rank 0.
        self.samples = True
        self.state = RunnerRequests()  # the requests as this runner knows them
        # The last launched step's sampled ids (on the device) and each request's row there:
        # the inputs of the next step's `pending` rows.
        self.draft = None  # gpu/draft.py DraftModel, with a draft_model speculative config
        self._last_sampled: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.lora = None  # gpu/lora.py LoraSlots (the model's), with --enable-lora

    def _tensor(self, data, dtype) -> torch.Tensor:
        # An array's memory is shared, not copied: the tensor keeps the array alive, and the
        # callers never resize an array they passed (that would move its memory).
        if isinstance(data, array) and data:
            t = torch.frombuffer(data, dtype=dtype)
        else:
            t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, out: SchedulerOutput, scheduled: list[RunnerRequest]):
        """Flatten the step: input ids, positions, slot mapping, block tables, logits rows."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_rows: list[int] = []
        pending: list[int] = []  # (input row, row of the last step's samples) pairs, flat
        for s, r in zip(out.scheduled, scheduled):
            n, start, table = s.num_new_tokens, s.start, r.table
            if n == 1:  # a decode: one token, one slot
                input_ids.append(r.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                drafts = s.draft_token_ids
                if drafts:  # known tokens, then the proposals to verify
                    input_ids.extend(r.token_ids[start : start + n - len(drafts)])
                    input_ids.extend(drafts)
                else:
                    input_ids.extend(r.token_ids[start : start + n])
                pos = range(start, start + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            seq_lens.append(start + n)
            if s.sample:  # a run of proposals: logits from the last known token on
                end = len(input_ids)
                logits_rows.extend(range(end - 1 - len(s.draft_token_ids), end))
            if s.pending:  # its last input is what the previous step sampled for it
                if start + n != len(r.token_ids):
                    raise ValueError(f"{s.request_id}: a pending token must end its chunk")
                pending += (len(input_ids) - 1, self._last_rows[s.request_id])
        tables = self.state.tables(scheduled)
        meta = AttentionMetadata.build(slots, tables, query_lens, seq_lens, self._tensor)
        n = len(input_ids)
        longs = self._tensor(input_ids + positions + logits_rows + pending, torch.int64)
        input_ids = longs[:n]
        if pending:
            at = longs[2 * n + len(logits_rows) :].view(-1, 2)
            input_ids[at[:, 0]] = self._last_sampled[at[:, 1]]
        return input_ids, longs[n : 2 * n], meta, longs[2 * n : 2 * n + len(logits_rows)]

    def _generator(self, request: RunnerRequest) -> torch.Generator:
        """A request's own generator, made from its seed on first use and kept with it."""
        if request.generator is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(request.sampling_params.seed)
            request.generator = g
        return request.generator

    def prepare_sampling(
        self, sampled: list[RunnerRequest], grammar=None, offsets: list[int] | None = None
    ) -> SamplingMetadata:
        """One row per entry of `sampled` (a request speculating has one per verified
        position: `offsets` counts the tokens before each row's within the run)."""
        requests = sampled
        params = [r.sampling_params for r in requests]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.greedy for p in params)
        if all_greedy and not asked:  # the argmax alone: no per-row tensors to build
            m = SamplingMetadata(all_greedy=True, grammar=grammar)
        else:
            top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
            m = SamplingMetadata(
                temperature=self._tensor([p.temperature for p in params], torch.float32),
                top_k=self._tensor(top_ks, torch.int64),
                top_p=self._tensor([p.top_p for p in params], torch.float32),
                min_p=self._tensor([p.min_p for p in params], torch.float32),
                all_greedy=all_greedy,
                need_top_k=any(k > 0 for k in top_ks),
                need_top_p=any(p.top_p < 1.0 for p in params),
                need_min_p=any(p.min_p > 0.0 for p in params),
                seeded=[
                    (i, self._generator(r))
                    for i, r in enumerate(requests)
                    if r.sampling_params.seed is not None and not r.sampling_params.greedy
                ],
                grammar=grammar,
            )
        bias_rows, bias_tokens, bias_values, ban_rows, ban_tokens = [], [], [], [], []
        for i, (r, p) in enumerate(zip(requests, params)):
            for token, value in p.logit_bias.items():
                bias_rows.append(i)
                bias_tokens.append(token)
                bias_values.append(value)
            early = r.num_output_tokens + (offsets[i] if offsets else 0) < p.min_tokens
            if early or p.bad_words_token_ids:
                banned = set()
                if early:
                    banned.update(p.stop_token_ids)
                    if not p.ignore_eos:
                        banned |= self.eos_token_ids
                if p.bad_words_token_ids:  # (never speculating: its outputs are all known)
                    banned.update(banned_by_bad_words(p.bad_words_token_ids, r.output_token_ids))
                ban_rows += [i] * len(banned)
                ban_tokens += banned
        if bias_rows:
            m.bias = (
                self._tensor(bias_rows, torch.int64),
                self._tensor(bias_tokens, torch.int64),
                self._tensor(bias_values, torch.float32),
            )
        if ban_rows:
            m.ban = (self._tensor(ban_rows, torch.int64), self._tensor(ban_tokens, torch.int64))
        if any(p.allowed_token_ids is not None for p in params):
            m.allowed = self._allowed(requests)
        if any(p.needs_penalties for p in params):
            self._penalties(m, requests, params)
        m.max_logprobs = max(asked) if asked else None
        return m

    def _allowed(self, requests: list[RunnerRequest]):
        """(rows, keep [rows, vocab]) of the rows with allowed_token_ids: one index per row,
        each request's ids copied to the device once."""
        rows = [
            i for i, r in enumerate(requests) if r.sampling_params.allowed_token_ids is not None
        ]
        keep = torch.zeros((len(rows), self.vocab_size), dtype=torch.bool, device=self.device)
        for j, i in enumerate(rows):
            r = requests[i]
            if r.allowed is None:
                r.allowed = self._tensor(r.sampling_params.allowed_token_ids, torch.int64)
            keep[j, r.allowed] = True
        return self._tensor(rows, torch.int64), keep

    def _penalties(self, m: SamplingMetadata, requests, params) -> None:
        n, vocab = len(requests), self.vocab_size
        out_rows, out_tokens, prompt_rows, prompt_tokens = [], [], [], []
        for i, r in enumerate(requests):
            if not params[i].needs_penalties:
                continue
            out_rows += [i] * r.num_output_tokens
            out_tokens += r.output_token_ids
            if params[i].repetition_penalty != 1.0:
                prompt_rows += [i] * r.num_prompt_tokens
                prompt_tokens += r.prompt_token_ids
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=self.device)
        if out_rows:
            counts.index_put_(
                (self._tensor(out_rows, torch.int64), self._tensor(out_tokens, torch.int64)),
                torch.ones(len(out_rows), device=self.device),
                accumulate=True,
            )
        mask = torch.zeros((n, vocab), dtype=torch.bool, device=self.device)
        if prompt_rows:
            mask[
                self._tensor(prompt_rows, torch.int64), self._tensor(prompt_tokens, torch.int64)
            ] = True
        m.output_counts, m.prompt_mask = counts, mask
        m.presence = self._tensor([p.presence_penalty for p in params], torch.float32)
        m.frequency = self._tensor([p.frequency_penalty for p in params], torch.float32)
        m.repetition = self._tensor([p.repetition_penalty for p in params], torch.float32)

    def _prompt_logprobs(
        self, out: SchedulerOutput, scheduled: list[RunnerRequest], hidden: torch.Tensor
    ) -> dict[str, list[Logprob]]:
        """Raw log-probs of the prompt tokens this step computed, for requests asking for them."""
        result: dict[str, list[Logprob]] = {}
        row = 0
        for s, r in zip(out.scheduled, scheduled):
            n = s.num_new_tokens
            k = r.sampling_params.prompt_logprobs
            # Row j predicts position start + j + 1; only prompt positions are scored.
            last = min(s.start + n, r.num_prompt_tokens - 1)
            if k is not None and s.start < last:
                count = last - s.start
                logprobs = self.model.compute_logits(hidden[row : row + count]).log_softmax(-1)
                targets = torch.tensor(r.token_ids[s.start + 1 : last + 1], device=self.device)
                chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
                top_v, top_i = logprobs.topk(k, dim=-1) if k else (None, None)
                entries = []
                for j in range(count):
                    entries.append(
                        Logprob(
                            int(targets[j]),
                            chosen[j],
                            top_i[j].tolist() if k else [],
                            top_v[j].tolist() if k else [],
                        )
                    )
                result[r.request_id] = entries
            row += n
        return result

    def _start_masks(self, grammar: GrammarBatch):
        """The grammars' bitmask for this step, filled while the forward runs: on CPU on a
        helper thread (llguidance releases the GIL), on a GPU after the forward is launched."""
        if self.device.type != "cpu":
            return lambda: grammar_mask.build(grammar, self.device)
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="weir-mask")
        future = self._mask_pool.submit(grammar_mask.build, grammar, self.device)
        return future.result

    def execute(
        self, out: SchedulerOutput, grammar: GrammarBatch | None = None, masks=None
    ) -> StepResult:
        """`grammar`: the constrained rows and their mask fill (the engine's matchers); `masks`
        instead: a callable giving this step's (rows, bitmask) tensors, for a rank that
        receives them (gpu/dist/worker.py)."""
        return self.submit(out, grammar, masks).result()

    @torch.inference_mode()
    def submit(
        self, out: SchedulerOutput, grammar: GrammarBatch | None = None, masks=None
    ) -> LaunchedStep:
        """The step's work queued on the device (on a CPU, done): nothing here waits for the
        GPU unless the step asks for prompt log-probs or pooled vectors."""
        scheduled = self.state.update(out)
        if out.copies:
            self._copy_blocks(out.copies)
        if self.draft is not None:  # proposals for the rows that speculate
            self.draft.propose(out, scheduled, self._tensor)
        input_ids, positions, meta, logits_rows = self.prepare(out, scheduled)
        lora = None  # no adapter in the step: no LoRA work at all
        if self.lora is not None:
            lora = self.lora.batch(
                [r.lora for r in scheduled], [s.num_new_tokens for s in out.scheduled], self._tensor
            )
        if grammar is not None and self.samples:
            masks = self._start_masks(grammar)
        if self.model.pooling_only:  # an encoder: each input whole, nothing sampled
            starts = [r.pooling.type_start if r.pooling else None for r in scheduled]
            hidden, logits = self.model.encode(input_ids, positions, meta, starts), None
        else:
            hidden, logits = replay_or_run(
                self.model,
                self.kv_caches,
                (self.graphs, self.verify_graphs),
                input_ids,
                positions,
                meta,
                logits_rows,
                lora,
            )
        if self.draft is not None and not any(s.draft_token_ids for s in out.scheduled):
            self.draft.catch_up(input_ids, positions, meta)  # (after a verification: advance)
        grammar_rows = masks() if masks is not None else None
        prompt_lp = {}
        if any(r.sampling_params.prompt_logprobs is not None for r in scheduled):
            prompt_lp = self._prompt_logprobs(out, scheduled, hidden)
        pooled = {}
        if self.samples and any(r.pooling is not None for r in scheduled):
            classify = self.model.classify if self.model.classifies else None
            pooled = pool(out, scheduled, hidden, classify, self.projector)
        if logits_rows.numel() == 0:
            return LaunchedStep([], None, prompt_lp, pooled)
        self.last_logits = logits
        if not self.samples:
            return LaunchedStep([], None)
        runs = [
            (r, len(s.draft_token_ids) + 1) for s, r in zip(out.scheduled, scheduled) if s.sample
        ]
        if len(runs) == logits_rows.numel():  # one row a request: nothing proposed
            requests = [r for r, _ in runs]
            sampled = self.sampler(logits, self.prepare_sampling(requests, grammar_rows))
            accepted = None
        else:
            sampled, accepted = self._verify(out, runs, logits, grammar_rows)
            requests = [r for r, n in runs for _ in range(n)]
            if self.draft is not None:  # caught up as far as kept: the next first proposals
                verdicts = sampled.token_ids.tolist(), accepted.tolist()
                self.draft.advance(out, scheduled, *verdicts, self._tensor)
        self._last_sampled = sampled.token_ids
        self._last_rows = {r.request_id: i for i, r in enumerate(requests)}  # a run's last row
        step = LaunchedStep(requests, sampled, prompt_lp, pooled, runs, accepted)
        if any(r.sampling_params.beam_width for r in requests):
            step.beams = self._beam_candidates(logits, requests)
        return step

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """K/V blocks copied on every layer before the forward (a beam's copy of a partial
        block it shared): torch indexing, so the same on every device and cache dtype (an FP8
        cache's bytes: torch does not index float8 tensors on every device)."""
        src = self._tensor([s for s, _ in copies], torch.int64)
        dst = self._tensor([d for _, d in copies], torch.int64)
        for kv in self.kv_caches:
            for cache in kv:
                cache = cache.view(torch.uint8) if cache.element_size() == 1 else cache
                cache[dst] = cache[src]

    def _beam_candidates(self, logits: torch.Tensor, requests: list[RunnerRequest]):
        """Each beam row's top candidates: the model's own log-probabilities (as transformers'
        beam search ranks them: log-softmax of the logits, then EOS and stop tokens at -inf
        before min_tokens), as many as its search looks at (or its log-probs ask for)."""
        rows, ks, ban_rows, ban_tokens = [], [], [], []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.beam_width:
                continue
            if r.num_output_tokens < p.min_tokens:
                banned = stop_ids(p, self.eos_token_ids)
                ban_rows += [len(rows)] * len(banned)
                ban_tokens += banned
            rows.append(i)
            ks.append(max(num_candidates(p, self.eos_token_ids), p.logprobs or 0))
        lps = logits.index_select(0, self._tensor(rows, torch.int64)).float().log_softmax(-1)
        if ban_rows:
            where = (self._tensor(ban_rows, torch.int64), self._tensor(ban_tokens, torch.int64))
            lps = lps.index_put(where, torch.tensor(float("-inf"), device=lps.device))
        values, ids = lps.topk(min(max(ks), lps.shape[1]), dim=-1)
        # On the host before the step is handed back (a blocking copy on a GPU): the engine
        # ranks them before it schedules again anyway.
        return [requests[i].request_id for i in rows], ks, values.cpu(), ids.cpu()

    def _verify(self, out: SchedulerOutput, runs, logits, grammar_rows):
        """Speculative runs: a logits row per verified position, the sampler's verdicts."""
        requests, offsets, drafts = [], [], []
        for s in out.scheduled:
            if s.sample:
                drafts += [*s.draft_token_ids, -1]
        for r, n in runs:
            requests += [r] * n
            offsets += range(n)
        # (grammar rows count every verified position: core/engine_core.py _grammar_batch)
        m = self.prepare_sampling(requests, grammar_rows, offsets)
        return self.sampler.verify(logits, m, self._tensor(drafts, torch.int64))
