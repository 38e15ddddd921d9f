"""The sampler's tensor code against plain-Python reference formulas, and stop-string matching."""

from __future__ import annotations

import math

import torch

from core.stop import StopStrings
from gpu.backend import TorchBackend
from gpu.sampler import Sampler as _Sampler
from gpu.sampler import SamplingMetadata, apply_penalties, filter_logits


def Sampler(seed: int, device: torch.device, mode: str = "raw_logprobs") -> _Sampler:  # noqa: N802
    """The class, on torch ops."""
    return _Sampler(seed, device, TorchBackend(None, fuse=False), mode)


def meta(n, **kw):
    base = dict(
        temperature=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        all_greedy=False,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def test_penalties_follow_the_reference_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 3
    outputs = [[1, 1, 4], [], [7, 2, 2, 2]]
    prompts = [[3, 4], [5], [0]]
    presence, frequency, repetition = [0.5, 0.0, -0.3], [0.2, 1.0, 0.7], [1.3, 1.0, 0.8]
    counts = torch.zeros(3, 12)
    mask = torch.zeros(3, 12, dtype=torch.bool)
    for i in range(3):
        for t in outputs[i]:
            counts[i, t] += 1
        for t in prompts[i]:
            mask[i, t] = True
    got = apply_penalties(
        logits,
        counts,
        mask,
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    for i in range(3):
        for t in range(12):
            x = logits[i, t].item()
            if t in outputs[i] or t in prompts[i]:
                x = x / repetition[i] if x > 0 else x * repetition[i]
            c = outputs[i].count(t)
            x -= frequency[i] * c + presence[i] * (c > 0)
            assert math.isclose(got[i, t].item(), x, rel_tol=1e-5, abs_tol=1e-5)


def test_top_k_top_p_min_p_keep_what_they_should():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = lambda out: (out > float("-inf")).nonzero()[:, 1].tolist()  # noqa: E731
    one = torch.ones(1)
    assert kept(
        filter_logits(logits, torch.tensor([2]), one, torch.zeros(1), True, False, False)
    ) == [0, 1]
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is still needed; the fourth is not.
    assert kept(
        filter_logits(
            logits, torch.tensor([0]), torch.tensor([0.8]), torch.zeros(1), False, True, False
        )
    ) == [0, 1, 2]
    # min_p 0.3: keep tokens with p >= 0.3 * 0.5 = 0.15.
    assert kept(
        filter_logits(logits, torch.tensor([0]), one, torch.tensor([0.3]), False, False, True)
    ) == [0, 1, 2]


def test_bias_ban_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 2)
    m = meta(
        2,
        temperature=torch.zeros(2),
        all_greedy=True,
        max_logprobs=2,
        bias=(torch.tensor([0]), torch.tensor([2]), torch.tensor([10.0])),
        ban=(torch.tensor([1]), torch.tensor([1])),
    )
    out = Sampler(0, torch.device("cpu"), "processed_logprobs")(logits, m)
    assert out.token_ids.tolist() == [2, 3]  # row 0 biased to 2; row 1 has 1 banned, so 3
    ref0 = torch.tensor([0.0, 5.0, 11.0, 2.0]).log_softmax(-1)
    assert math.isclose(out.logprobs[0].item(), ref0[2].item(), rel_tol=1e-6)
    assert out.top_ids[0].tolist() == [2, 1]
    # raw (vLLM's default): the same tokens, their log-probs the model's own
    raw = Sampler(0, torch.device("cpu"))(logits, m)
    assert raw.token_ids.tolist() == [2, 3]
    model = logits[0].log_softmax(-1)
    assert raw.logprobs.tolist() == [model[2].item(), model[3].item()]
    assert raw.top_ids.tolist() == [[1, 3], [1, 3]]  # the banned token is still the model's best
    logits_mode = Sampler(0, torch.device("cpu"), "raw_logits")(logits, m)
    assert logits_mode.logprobs.tolist() == [1.0, 2.0]


def test_raw_logprobs_do_not_depend_on_temperature_or_filters():
    """A request's log-probs are the model's distribution whatever it samples with: no -inf for
    tokens top-k leaves out, the same numbers at temperature 0.3 and 1.5 (vLLM's raw_logprobs,
    and OpenAI's)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    model = logits.log_softmax(-1)
    for temperature in (0.3, 1.5):
        m = meta(
            3, temperature=torch.full((3,), temperature), max_logprobs=5,
            top_k=torch.tensor([2, 2, 2]), need_top_k=True,
        )  # fmt: skip
        out = Sampler(1, torch.device("cpu"))(logits, m)
        torch.testing.assert_close(out.top_logprobs, model.topk(5, dim=-1).values)
        assert torch.equal(out.logprobs, model.gather(1, out.token_ids[:, None]).squeeze(1))
        processed = Sampler(1, torch.device("cpu"), "processed_logprobs")(logits, m)
        assert (processed.top_logprobs[:, 2:] == float("-inf")).all()  # top-k 2 left them out


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))

    def draw(batch_rows: int, steps: int = 5) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        sampler = Sampler(batch_rows, torch.device("cpu"))
        batch = logits.repeat(batch_rows, 1)
        return [
            sampler(batch, meta(batch_rows, seeded=[(batch_rows - 1, gen)])).token_ids[-1].item()
            for _ in range(steps)
        ]

    assert draw(1) == draw(4) == draw(7)


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.2), math.log(0.1)]]).repeat(4000, 1)
    out = Sampler(3, torch.device("cpu"))(logits, meta(4000))
    freq = torch.bincount(out.token_ids, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_sampling_never_draws_a_filtered_token_and_mixes_greedy_rows():
    # Allowed tokens sit between banned ones, at both ends of the vocabulary too: a token with
    # probability 0 must never be drawn, whatever the uniform number falls on.
    vocab, rows = 9, 3000
    logits = torch.zeros(rows, vocab)
    logits[:, [0, 3, 4, 8]] = float("-inf")
    logits[0] = torch.arange(vocab, dtype=torch.float32)  # a greedy row: argmax is 8
    temperature = torch.ones(rows)
    temperature[0] = 0.0
    out = Sampler(7, torch.device("cpu"))(logits, meta(rows, temperature=temperature))
    assert out.token_ids[0].item() == 8
    drawn = torch.bincount(out.token_ids[1:], minlength=vocab)
    assert drawn[[0, 3, 4, 8]].sum().item() == 0
    # The five allowed tokens are equally likely: each near a fifth of the draws.
    assert torch.allclose(
        drawn[[1, 2, 5, 6, 7]].float() / (rows - 1), torch.full((5,), 0.2), atol=0.03
    )


def test_stop_strings_across_boundaries_and_hold_back():
    s = StopStrings(["END", "stop here"], include_in_output=False)
    # The last len("stop here") - 1 = 8 characters are held: they could start a stop string.
    assert s.feed("hello world E") == ("hello", None)
    assert s.feed("N") == (" ", None)
    assert s.feed("D and more") == ("world ", "END")  # "END" split over three tokens
    inc = StopStrings(["END"], include_in_output=True)
    text, matched = inc.feed("abcEN")
    rest, matched = inc.feed("Dxyz")
    assert matched and text + rest == "abcEND"
    tail = StopStrings(["zzz"], include_in_output=False)
    text, _ = tail.feed("abz")
    assert text + tail.flush() == "abz"  # the request ended another way: release the tail


def test_cpu_argmax_is_torchs_on_ties_nans_infs_and_views():
    from gpu.attention.select import get_backend
    from gpu.cpu.backend import CpuBackend

    argmax = CpuBackend(get_backend("auto", torch.device("cpu"))).argmax

    torch.manual_seed(0)
    x = torch.randn(70, 1876)
    x[1, 5] = x[1, 900] = 50.0  # a tie: the first wins
    x[2] = float("-inf")
    x[3, 7] = float("nan")
    x[3, 3] = float("nan")  # the first NaN wins over any number
    x[4, 10] = float("inf")
    x[5] = 0.0
    x[5, 11] = -0.0
    for logits in (x, x[:, :1000], x[:1], x[::2]):
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_all_greedy_rows_need_no_sampling_tensors():
    logits = torch.randn(4, 50)
    m = SamplingMetadata(all_greedy=True)
    assert torch.equal(Sampler(0, torch.device("cpu"))(logits, m).token_ids, logits.argmax(-1))
