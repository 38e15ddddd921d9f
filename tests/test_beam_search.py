"""Beam search in the engine: the sequences, and their order, of transformers' beam search
(`generate(num_beams=n, num_return_sequences=n, length_penalty, early_stopping)`) on the same
weights in float32, with greedy requests in the same batches, with a pool roomy enough that
beams fork by sharing blocks (and asynchronous scheduling, on Qwen3) and one small enough that
beam searches are preempted whole and recomputed; the pool's invariants after every step."""

from __future__ import annotations

import pytest
import torch

from core.config import EngineConfig
from core.request import EngineRequest
from core.sampling import InvalidParam, SamplingParams
from gpu.launch import load

PROMPTS = ["hello", "where did the people go"]
# (width, length_penalty, early_stopping, max_tokens, min_tokens, extra stop token ids)
SEARCHES = [
    (2, 1.0, False, 12, 0, False),
    (4, 0.5, True, 12, 0, True),
    (3, 2.0, "never", 10, 0, False),
    (4, -1.0, False, 12, 0, True),
    (5, 1.0, False, 12, 4, True),
    (6, 0.0, False, 14, 0, True),
]
# Frequent tokens of the tiny models' outputs made stop tokens, so hypotheses end early.
STOPS = [5, 17, 40, 100, 7]
GREEDY_TOKENS = 16

POOLS = {
    "roomy": dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=2048),
    # 40 blocks of 4 tokens for 12 beam searches and 2 greedy requests: preemption all along.
    "tight": dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=48),
}

_reference: dict[str, tuple] = {}


def hf_beams(hf, ids, width, penalty, early, max_tokens, min_tokens, eos) -> list[list[int]]:
    out = hf.generate(
        torch.tensor([ids]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens or None,
        length_penalty=penalty,
        early_stopping=early,
        eos_token_id=eos,
        pad_token_id=0,
    )
    seqs = []
    for row in out.tolist():
        gen = row[len(ids) :]
        # finished hypotheses are padded with the first EOS after theirs: cut after their own
        end = next((j + 1 for j, t in enumerate(gen) if t in eos), len(gen))
        seqs.append(gen[:end])
    return seqs


def reference(arch: str, path, prompts: list[list[int]], eos: list[int]):
    if arch not in _reference:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # The random tiny models' activations underflow: denormals made transformers' CPU
        # products 30 times slower, and flushed they change no logit. One thread: on a busy
        # machine two threads of products this small mostly wait for each other.
        torch.set_flush_denormal(True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        beams = {}
        for p, ids in enumerate(prompts):
            for s, (width, penalty, early, max_tokens, min_tokens, stops) in enumerate(SEARCHES):
                stop_ids = eos + (STOPS if stops else [])
                beams[p, s] = hf_beams(
                    hf, ids, width, penalty, early, max_tokens, min_tokens, stop_ids
                )
        greedy = [
            hf.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=GREEDY_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            for ids in prompts
        ]
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
        _reference[arch] = beams, greedy
    return _reference[arch]


def beam_params(width, penalty, early, max_tokens, min_tokens, stops, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        beam_width=width,
        length_penalty=penalty,
        early_stopping=early,
        stop_token_ids=STOPS if stops else [],
        **kw,
    )


def test_forked_blocks_are_shared_and_copied_on_write():
    """A fork shares every block; the first beam to write into a shared partial block takes a
    copy (one more block, counted before it is taken), the last writes in place; a copy not
    yet sent is dropped with its sequence; the pool's invariants hold throughout."""
    from core.kv_cache_manager import KVCacheManager
    from core.request import Request

    kv = KVCacheManager(num_blocks=6, block_size=4)

    def seq(rid: str) -> Request:
        return Request(EngineRequest(rid, list(range(6)), SamplingParams()), 8)

    a, b, c = seq("a"), seq("b"), seq("c")
    kv.allocate(a, 6)
    a.num_computed_tokens = 6  # two blocks, the second holding 2 of 4 tokens
    for child in (b, c):
        kv.fork(child, a)
        child.num_computed_tokens = 6
    kv.check_integrity()
    assert [blk.ref_cnt for blk in kv.tables["a"]] == [3, 3]
    assert kv.num_free_blocks == 4
    assert kv.blocks_needed(a, 1) == 1 and kv.blocks_needed(a, 3) == 2
    shared = kv.block_tables["a"][1]
    kv.allocate(a, 1)  # a writes its 7th token: into a copy of the shared block
    assert kv.block_tables["a"][1] != shared and kv.block_tables["b"][1] == shared
    kv.allocate(b, 1)  # b too (c still shares it)
    copies = kv.take_copies()
    assert sorted(copies) == sorted(
        [(shared, kv.block_tables["a"][1]), (shared, kv.block_tables["b"][1])]
    )
    assert kv.blocks_needed(c, 1) == 0  # c alone holds it now: it writes in place
    kv.allocate(c, 1)
    assert kv.block_tables["c"][1] == shared and not kv.copies
    kv.check_integrity()
    d = seq("d")
    kv.fork(d, a)
    d.num_computed_tokens = 7
    kv.allocate(d, 1)
    assert kv.copies
    kv.free(d)  # preempted before its step was sent: its copy goes with it
    assert not kv.copies
    for r in (a, b, c):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_beams_match_transformers(arch, pool, model_dir):
    path = model_dir(arch)
    extra = {"async_scheduling": True} if arch == "qwen3" and pool == "roomy" else {}
    loaded = load(
        EngineConfig(model=str(path), dtype="float32", check_integrity=True, **POOLS[pool], **extra)
    )
    core = loaded.core
    copies = []
    copy_blocks = core.runner._copy_blocks
    core.runner._copy_blocks = lambda pairs: (copies.extend(pairs), copy_blocks(pairs))
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    want_beams, want_greedy = reference(arch, path, prompts, sorted(core.eos_token_ids))
    for p, ids in enumerate(prompts):
        for s, search in enumerate(SEARCHES):
            core.add(EngineRequest(f"{p}-{s}", ids, beam_params(*search)))
        greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        core.add(EngineRequest(f"greedy-{p}", ids, greedy))
    outs, greedy_ids = {}, {f"greedy-{p}": [] for p in range(len(prompts))}
    while core.has_work:
        for out in core.step():
            if out.request_id in greedy_ids:
                greedy_ids[out.request_id] += out.new_token_ids
                continue
            assert out.request_id not in outs  # one output, at the end
            outs[out.request_id] = out
    for (p, s), want in want_beams.items():
        out = outs[f"{p}-{s}"]
        assert [b.token_ids for b in out.beams] == want, (p, SEARCHES[s])
        scores = [b.score for b in out.beams]
        assert scores == sorted(scores, reverse=True)
        assert out.new_token_ids == want[0] and out.finished
    for p, want in enumerate(want_greedy):
        assert greedy_ids[f"greedy-{p}"] == want
    assert copies, "expected beams writing into copies of shared partial blocks"
    if pool == "tight":
        assert core.scheduler.num_preemptions > 0
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert not core.requests and not core.scheduler.groups


def test_beams_at_two_ranks(model_dir):
    """Tensor parallelism (two CPU workers): every rank copies the shared partial blocks a fork
    writes into, rank 0 ranks the candidates; the sequences and their order are still
    transformers'."""
    path = model_dir("qwen3")
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu", tensor_parallel_size=2, **POOLS["roomy"]
    )
    core = load(config).core
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        want_beams, _ = reference("qwen3", path, prompts, sorted(core.eos_token_ids))
        for p, ids in enumerate(prompts):
            for s, search in enumerate(SEARCHES[:4]):
                core.add(EngineRequest(f"{p}-{s}", ids, beam_params(*search)))
        outs = {}
        while core.has_work:
            for out in core.step():
                outs[out.request_id] = out
        for p in range(len(prompts)):
            for s in range(4):
                got = [b.token_ids for b in outs[f"{p}-{s}"].beams]
                assert got == want_beams[p, s], (p, SEARCHES[s])
        assert core.kv.num_free_blocks == core.kv.num_blocks
    finally:
        core.close()


def test_beam_outputs_logprobs_stops_and_abort(model_dir):
    """Each returned sequence's log-probs add up to its cumulative log-prob; a stop string ends
    a hypothesis (its text cut before it); an aborted beam search frees every block and the
    runner forgets every beam."""
    loaded = load(
        EngineConfig(
            model=str(model_dir("qwen3")),
            dtype="float32",
            check_integrity=True,
            num_kv_blocks=128,
            block_size=4,
        )
    )
    core, tok = loaded.core, loaded.tokenizer
    ids = tok.encode("the model is a server")
    core.add(EngineRequest("lp", ids, beam_params(3, 1.0, False, 8, 0, False, logprobs=2)))
    core.add(EngineRequest("long", ids, beam_params(4, 1.0, "never", 40, 0, False)))
    outs = {}
    for _ in range(6):
        for out in core.step():
            outs[out.request_id] = out
    found = core.abort("long")
    assert found is not None and found.finish_reason == "abort"
    while core.has_work:
        for out in core.step():
            outs[out.request_id] = out
    assert "long" not in outs
    assert core.kv.num_free_blocks == core.kv.num_blocks
    core.add(EngineRequest("tail", ids, SamplingParams(temperature=0, max_tokens=1)))
    while core.has_work:
        core.step()
    assert set(core.runner.state.requests) == {"tail"}  # every beam forgotten
    lp = outs["lp"]
    assert len(lp.beams) == 3
    for beam in lp.beams:
        assert len(beam.logprobs) == len(beam.token_ids)
        assert [e.token_id for e in beam.logprobs] == beam.token_ids
        assert all(len(e.top_ids) == 2 for e in beam.logprobs)
        assert sum(e.logprob for e in beam.logprobs) == pytest.approx(
            beam.cumulative_logprob, abs=1e-3
        )
        assert beam.text == tok.decode(beam.token_ids, skip_special_tokens=True)
    # The commonest letter of those sequences made a stop string: hypotheses end there, cut.
    text = "".join(b.text for b in lp.beams)
    stop = max((c for c in text if c.isalpha()), key=text.count)
    # a negative length penalty favours short hypotheses: those the stop ends win
    core.add(EngineRequest("stop", ids, beam_params(3, -2.0, True, 8, 0, False, stop=[stop])))
    while core.has_work:
        for out in core.step():
            outs[out.request_id] = out
    for beam in outs["stop"].beams:
        assert stop not in beam.text
        if beam.finish_reason == "stop":
            assert stop in tok.decode(beam.token_ids)
    assert any(b.finish_reason == "stop" for b in outs["stop"].beams)


def test_beam_params_refused_naming_the_field(model_dir):
    for field, kw in [
        ("temperature", {"temperature": 0.7}),
        ("top_p", {"temperature": 0, "top_p": 0.9}),
        ("top_k", {"temperature": 0, "top_k": 5}),
        ("logit_bias", {"temperature": 0, "logit_bias": {3: 1.0}}),
        ("early_stopping", {"temperature": 0, "early_stopping": "soon"}),
        ("prompt_logprobs", {"temperature": 0, "prompt_logprobs": 1}),
    ]:
        with pytest.raises(InvalidParam) as e:
            SamplingParams(beam_width=2, **kw).validate()
        assert e.value.param == field
    loaded = load(EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=32, max_beam_width=4))
    with pytest.raises(InvalidParam) as e:
        loaded.core.check(EngineRequest("x", [1, 2], beam_params(5, 1.0, False, 4, 0, False)))
    assert e.value.param == "n" and "--max-beam-width" in e.value.message
    # a search the cache can never hold: 32 blocks of 16; 4 beams share the prompt's 16 whole
    # blocks and each needs 6 more (its partial block and 80 tokens): 40. It had waited at the
    # head of the queue forever, with every request behind it.
    prompt = [1 + i % 50 for i in range(257)]
    with pytest.raises(InvalidParam) as e:
        loaded.core.check(EngineRequest("x", prompt, beam_params(4, 1.0, False, 80, 0, False)))
    assert e.value.param == "n" and "needs up to 40 KV cache blocks" in e.value.message
    loaded.core.check(EngineRequest("x", prompt, beam_params(2, 1.0, False, 80, 0, False)))


def test_a_beam_search_that_can_never_be_admitted_fails_and_frees_the_queue(
    model_dir, monkeypatch
):
    """Preempted beams whose shared prefix was evicted may need more blocks than the cache has:
    with nothing running, the scheduler marks the search stuck and the engine ends it with an
    error; the request behind it runs."""
    from core.scheduler import Scheduler

    loaded = load(EngineConfig(model=str(model_dir("qwen3")), num_kv_blocks=32))
    core = loaded.core
    monkeypatch.setattr(Scheduler, "_admit_beams", lambda self, *a: None)
    core.add(EngineRequest("beams", [1, 2, 3], beam_params(2, 1.0, False, 4, 0, False)))
    core.add(EngineRequest("next", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2)))
    outs = {}
    while core.has_work:
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    last = outs["beams"][-1]
    assert last.finish_reason == "error" and "beam search" in last.error
    assert last.error_status == 503  # the server could not hold it then: retry later (not a 500)
    assert outs["next"][-1].finished and len(outs["next"][-1].new_token_ids) >= 1
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_llm_beam_search(model_dir):
    """vLLM's LLM.beam_search: a prompt's sequences best first, prompt included, as the
    engine's; at most `concurrency_limit` prompts at once gives the same."""
    from weir import LLM, BeamSearchParams

    llm = LLM(str(model_dir("qwen3")), num_kv_blocks=128, dtype="float32")
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    prompts = ["hello", {"prompt": "the river"}, {"prompt_token_ids": [5, 6, 7]}]
    outs = llm.beam_search(prompts, params)
    one_by_one = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in one_by_one] == [
        [s.tokens for s in o.sequences] for o in outs
    ]
    ids = llm.tokenizer.encode("hello")
    core = llm.engine
    core.add(EngineRequest("ref", ids, params.sampling_params()))
    while core.has_work:
        for out in core.step():
            ref = out
    seqs = outs[0].sequences
    assert [s.tokens for s in seqs] == [ids + b.token_ids for b in ref.beams]
    assert [s.cum_logprob for s in seqs] == pytest.approx(
        [b.cumulative_logprob for b in ref.beams], abs=1e-4
    )
    assert seqs[0].text == llm.tokenizer.decode(ids) + ref.beams[0].text
    assert outs[2].sequences[0].tokens[:3] == [5, 6, 7]
    assert all(len(o.sequences) == 3 for o in outs)


def test_an_engine_error_keeps_its_status_on_the_wire():
    """What the HTTP routes answer for a request the engine ended with an error: its status (503
    for a beam search the cache could not hold then, 400 for the request's own fault found in
    the engine), a 500 only for the engine's own failure."""
    from core.request import RequestOutput
    from server.submit import engine_error

    def out(status):
        return RequestOutput(request_id="r", finished=True, error="why", error_status=status)

    stuck, bad, fault = engine_error(out(503)), engine_error(out(400)), engine_error(out(500))
    assert (stuck.status, stuck.message, stuck.code) == (503, "why", "server_overloaded")
    assert (bad.status, bad.code) == (400, "invalid_value")
    assert (fault.status, fault.message) == (500, "The engine failed: why")
    merged = RequestOutput(request_id="r").merge(out(503))
    assert merged.error_status == 503
