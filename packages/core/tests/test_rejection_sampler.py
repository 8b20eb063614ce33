"""The rejection sampler: greedy verification exactly, sampled verification keeping the target's
distribution (chi-square over many draws on a tiny vocabulary), seeded requests reproducible, and a
seeded request's token at a position the plain sampler's there, with or without a draft."""

from __future__ import annotations

import pytest
import torch

from kvik.layers.sampler import Sampler, SamplingBatch
from kvik.spec_decode.rejection_sampler import RejectionSampler, target_probs


def batch(
    n: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seeds=None,
    device: str = "cpu",
):
    """``seeds``: row -> seed, or (seed, output index of the row's first position)."""
    seeds = {row: s if isinstance(s, tuple) else (s, 0) for row, s in (seeds or {}).items()}
    return SamplingBatch(
        temperature=torch.full((n,), temperature, device=device),
        top_k=torch.full((n,), top_k, dtype=torch.int64, device=device),
        top_p=torch.full((n,), top_p, device=device),
        min_p=torch.zeros(n, device=device),
        all_greedy=temperature == 0.0,
        seeds=seeds,
    )


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    """Target logits whose argmax at each row is the given token."""
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_longest_matching_prefix_then_the_targets_token():
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    # Request 0: all 3 drafts match -> 3 drafts + bonus. Request 1: second draft wrong -> 1 draft
    # + correction. Request 2: no drafts -> the target's token. Request 3: first draft wrong.
    drafts = [[4, 5, 6], [1, 2], [], [7]]
    target = [[4, 5, 6, 3], [1, 3, 0], [2], [6, 1]]
    out = sampler(
        one_hot_logits([t for row in target for t in row]),
        torch.tensor([t for row in drafts for t in row]),
        [len(d) for d in drafts],
        batch(4),
    )
    assert out.num_accepted.tolist() == [3, 1, 0, 0]
    assert out.to_lists() == [[4, 5, 6, 3], [1, 3], [2], [6]]
    assert out.token_ids.tolist() == [
        [4, 5, 6, 3],
        [1, 3, -1, -1],
        [2, -1, -1, -1],
        [6, -1, -1, -1],
    ]


def test_greedy_rows_beside_sampled_rows_stay_greedy():
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    sampling = batch(2, temperature=1.0)
    sampling.temperature[0] = 0.0
    out = sampler(one_hot_logits([4, 5, 1, 2, 3]), torch.tensor([4, 1, 2]), [2, 1], sampling)
    assert out.to_lists()[0] == [4, 5]  # the second draft (1) is not the argmax (5)


def test_an_all_greedy_batch_on_the_host_equals_greedy_rows_on_the_device():
    """All-greedy batches compare on the host (one read of the argmaxes); the same requests beside
    a sampled one go through the device path: their outputs are the same."""
    torch.manual_seed(3)
    num_drafts = [3, 0, 2, 4, 1]
    logits = torch.randn(sum(num_drafts) + len(num_drafts), 16)
    argmax = logits.argmax(dim=-1).tolist()
    drafts, row = [], 0
    for i, k in enumerate(num_drafts):  # drafts that match the argmax for a while, then not
        for j in range(k):
            drafts.append(argmax[row + j] if j < i else (argmax[row + j] + 1) % 16)
        row += k + 1
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    greedy = sampler(logits, torch.tensor(drafts), num_drafts, batch(len(num_drafts)))
    assert greedy.token_ids.device.type == "cpu"
    mixed = batch(len(num_drafts) + 1, temperature=1.0)
    mixed.temperature[: len(num_drafts)] = 0.0
    extra = torch.randn(2, 16)
    beside = sampler(
        torch.cat([logits, extra]), torch.tensor(drafts + [0]), num_drafts + [1], mixed
    )
    assert beside.to_lists()[: len(num_drafts)] == greedy.to_lists()
    assert greedy.num_accepted.tolist() == [0, 0, 2, 3, 1]
    # Kept on the logits' device (what an EAGLE-3 proposal starts from before the read-back):
    # the same tokens, and the same placeholders after each request's last.
    kept = sampler(logits, torch.tensor(drafts), num_drafts, batch(len(num_drafts)), on_device=True)
    assert kept.token_ids.tolist() == greedy.token_ids.tolist()
    assert kept.num_accepted.tolist() == greedy.num_accepted.tolist()


def test_bad_layouts_are_clear_errors():
    sampler = RejectionSampler(torch.Generator())
    with pytest.raises(ValueError, match="k_i \\+ 1 per request"):
        sampler(torch.zeros(3, 8), torch.tensor([1, 2]), [2, 0], batch(2))
    with pytest.raises(ValueError, match="draft_token_ids has shape"):
        sampler(torch.zeros(3, 8), torch.tensor([1]), [2], batch(1))
    with pytest.raises(ValueError, match="draft_probs has shape"):
        sampler(torch.zeros(3, 8), torch.tensor([1, 2]), [2], batch(1, 1.0), torch.zeros(2, 7))
    with pytest.raises(ValueError, match=">= 0"):
        sampler(torch.zeros(1, 8), torch.tensor([], dtype=torch.int64), [-1], batch(1))


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test over the categories with expected mass (those without must be empty)."""
    n = observed.sum()
    support = expected_probs > 0
    assert observed[~support].sum() == 0, "sampled a token the target gives probability 0"
    expected = expected_probs[support] * n
    statistic = ((observed[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


VOCAB = 6
DRAWS = 20_000


@pytest.mark.parametrize("top_p", [1.0, 0.7])
@pytest.mark.parametrize("proposer", ["model", "one_hot"])
def test_sampled_output_has_the_targets_distribution(top_p, proposer):
    """Each draw is a request with k = 2 drafts from q (or a fixed one-hot proposal); the first
    output token must follow p at position 0, and the second (present when the first draft was
    accepted) p at position 1, whatever q is."""
    torch.manual_seed(1)
    target_rows = torch.randn(3, VOCAB) * 1.5  # positions 0, 1 and the bonus position
    q = torch.randn(2, VOCAB).softmax(-1)
    target_logits = target_rows.repeat(DRAWS, 1)
    if proposer == "model":
        drafts = torch.stack([torch.multinomial(q[j], DRAWS, replacement=True) for j in (0, 1)], 1)
        draft_probs = q.repeat(DRAWS, 1)
    else:
        drafts = torch.tensor([[2, 4]]).repeat(DRAWS, 1)
        draft_probs = None
    sampling = batch(DRAWS, temperature=1.0, top_p=top_p)
    sampler = RejectionSampler(torch.Generator().manual_seed(2))
    out = sampler(target_logits, drafts.reshape(-1), [2] * DRAWS, sampling, draft_probs)
    p = target_probs(target_rows, batch(3, temperature=1.0, top_p=top_p), torch.arange(3))
    first = torch.bincount(out.token_ids[:, 0], minlength=VOCAB).float()
    assert chi_square_p_value(first, p[0]) > 0.01
    has_second = out.num_accepted >= 1
    assert int(has_second.sum()) > 2000  # enough draws to test the second position
    second = torch.bincount(out.token_ids[has_second, 1], minlength=VOCAB).float()
    assert chi_square_p_value(second, p[1]) > 0.01
    if top_p < 1.0:
        assert (p == 0).any()  # top-p did remove tokens, and none of them was emitted


def test_the_chi_square_test_rejects_a_wrong_distribution():
    # The check the test above relies on can fail: the proposer's own distribution is not p.
    torch.manual_seed(1)
    p = torch.randn(VOCAB).softmax(-1)
    q = torch.randn(VOCAB).softmax(-1)
    draws = torch.bincount(torch.multinomial(q, DRAWS, replacement=True), minlength=VOCAB)
    assert chi_square_p_value(draws.float(), p) < 1e-6


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(4 * 3, VOCAB)  # 4 requests, k = 2 each
    drafts = torch.randint(0, VOCAB, (8,))
    q = torch.randn(8, VOCAB).softmax(-1)

    def run(engine_seed: int, extra_first: bool):
        sampler = RejectionSampler(torch.Generator().manual_seed(engine_seed))
        lg, dr, qq = logits, drafts, q
        seeds = {1: 7, 3: 11}
        if extra_first:  # another request ahead of them: every row index shifts by one
            lg = torch.cat([torch.randn(3, VOCAB), logits])
            dr = torch.cat([torch.randint(0, VOCAB, (2,)), drafts])
            qq = torch.cat([torch.randn(2, VOCAB).softmax(-1), q])
            seeds = {2: 7, 4: 11}
        n = 5 if extra_first else 4
        out = sampler(lg, dr, [2] * n, batch(n, temperature=0.9, seeds=seeds), qq).to_lists()
        return out[1:] if extra_first else out

    base = run(0, False)
    again = run(5, True)
    assert again[1] == base[1] and again[3] == base[3]
    # Different seeds give different tokens somewhere (the seed is what decides them).
    outputs = set()
    for seed in range(8):
        sampler = RejectionSampler(torch.Generator().manual_seed(0))
        out = sampler(logits, drafts, [2] * 4, batch(4, 1.0, seeds={0: seed}), q).to_lists()
        outputs.add(tuple(out[0]))
    assert len(outputs) > 1


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_position_draws_the_same_with_or_without_drafts_before_it(device):
    """A seeded request's token at output position i comes from (seed, i) alone: the plain sampler
    gives it at row 0 or row 2 of a batch; verified with one-hot drafts (n-gram's), the output is
    the plain tokens' prefix whatever the drafts were and however many (a step's drafts cut by a
    token budget, a step without any), and the drafts that are accepted are those tokens."""
    torch.manual_seed(5)
    positions = 5
    # Peaked enough that drafts are often accepted.
    rows = (torch.randn(positions, VOCAB) * 2.0).to(device)
    likely = rows.argmax(-1).tolist()
    sampler = Sampler(torch.Generator(device).manual_seed(0))
    rejection = RejectionSampler(torch.Generator(device).manual_seed(0))
    accepted = 0
    for seed in range(40):
        plain = [
            sampler(rows[i : i + 1].clone(), batch(1, 1.0, seeds={0: (seed, i)}, device=device))
            for i in range(positions)
        ]
        plain = [t.item() for t in plain]
        beside = torch.cat([torch.randn(2, VOCAB).to(device), rows[2:3]])  # after two others
        at_two = sampler(beside, batch(3, 1.0, seeds={2: (seed, 2)}, device=device))
        assert at_two[2].item() == plain[2]
        # From position 1, with 0 to 3 drafts: the likely tokens, or the likely ones but the last.
        for k in range(positions - 1):
            for drafts in (likely[1 : 1 + k], likely[1:k] + [(likely[k] + 1) % VOCAB]):
                drafts = drafts[:k]
                other = torch.randn(3, VOCAB).to(device)  # an unseeded request, 2 drafts
                out = rejection(
                    torch.cat([other, rows[1 : 2 + k]]),
                    torch.tensor([0, 1, *drafts]),
                    [2, k],
                    batch(2, 1.0, seeds={1: (seed, 1)}, device=device),
                )
                tokens = out.to_lists()[1]
                assert tokens == plain[1 : 1 + len(tokens)], (seed, drafts)
                assert tokens[:-1] == drafts[: len(tokens) - 1]
                accepted += len(tokens) - 1
    assert accepted > 100  # drafts were accepted, not only rejected


def test_seeded_positions_differ():
    """Neighbouring positions and seeds draw differently (position_seed mixes both)."""
    rows = torch.zeros(1, 1000)  # uniform: the token is the noise's argmin
    sampler = Sampler(torch.Generator())
    tokens = {
        sampler(rows.clone(), batch(1, 1.0, seeds={0: (seed, i)})).item()
        for seed in (0, 1, -1, 2**63 - 1)
        for i in range(4)
    }
    assert len(tokens) >= 14


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_cuda_like_on_cpu():
    logits = one_hot_logits([4, 5, 6, 3]).cuda()
    out = RejectionSampler(torch.Generator("cuda"))(
        logits,
        torch.tensor([4, 5, 1]).cuda(),
        [3],
        batch(1).__class__(
            **{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(batch(1)).items()}
        ),
    )
    assert out.to_lists() == [[4, 5, 6]]


def test_the_distribution_check_catches_a_wrong_acceptance_rule():
    """Drafts from q, but the sampler told q = p: it then accepts every draft and emits q's
    distribution, which the same chi-square check must reject."""
    torch.manual_seed(1)
    target_rows = torch.randn(2, VOCAB) * 1.5
    q = torch.randn(VOCAB).softmax(-1)
    drafts = torch.multinomial(q, DRAWS, replacement=True)
    p = target_rows.softmax(-1)
    out = RejectionSampler(torch.Generator().manual_seed(2))(
        target_rows.repeat(DRAWS, 1), drafts, [1] * DRAWS, batch(DRAWS, 1.0), p[:1].repeat(DRAWS, 1)
    )
    first = torch.bincount(out.token_ids[:, 0], minlength=VOCAB).float()
    assert chi_square_p_value(first, p[0]) < 1e-6


def test_sampled_requests_with_different_draft_counts():
    """k = 0, 1 and 3 in one sampled batch: each output is its accepted drafts plus one token,
    and a target that puts all its mass on the drafts accepts them all."""
    drafts = [[], [3], [1, 4, 2]]
    rows = [[5], [3, 0], [1, 4, 2, 5]]  # the target's certain tokens, bonus last
    logits = one_hot_logits([t for row in rows for t in row]) * 10  # p ~ one-hot
    out = RejectionSampler(torch.Generator().manual_seed(0))(
        logits, torch.tensor([t for d in drafts for t in d]), [0, 1, 3], batch(3, 1.0)
    )
    assert out.num_accepted.tolist() == [0, 1, 3]
    assert out.to_lists() == [[5], [3, 0], [1, 4, 2, 5]]
