"""Speculative decoding: a draft on the GPU proposes k tokens, one streamed pass of the target
checks them all.

Streamed decode moves every streamed weight over the bus once per token, and a pass over a few
positions moves the same bytes as a pass over one. A target exported with ``speculate_k=k``
has a ``verify`` method of k + 1 tokens. Each round the draft (a smaller program, held
resident) decodes k tokens greedily; the target runs ``verify`` over the last accepted token and
the k drafted ones, at their positions; the longest prefix of drafted tokens that equal the
target's own choices is accepted, plus the target's token after it: 1 to k + 1 tokens per
weight pass, each the token the target's greedy decode would choose there.

Rolling back costs nothing: both caches are static, each position written before it is
attended to and masked until then, so the entries of rejected tokens are overwritten by the
next round's writes. Near the end of the cache, where k + 1 positions do not fit, rounds fall
back to plain decode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from hostswap.llm import DECODE, VERIFY, GenerationError, decode_tokens
from hostswap.sampling import check_drawn, draw, sampled_logprobs


@dataclasses.dataclass
class SpeculationStats:
    """What the last speculative ``generate`` measured."""

    passes: int = 0  # verify passes of the target
    plain_steps: int = 0  # target decode steps: where k + 1 positions did not fit, or speculation did not pay
    drafted: int = 0
    draft_steps: int = 0  # decode calls of the draft: the proposals, and the catching up on a round's last tokens
    accepted: int = 0  # drafted tokens the target agreed with
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rejections: int = 0  # rounds that ended at a proposal the target did not keep
    k: list[int] = dataclasses.field(default_factory=list)  # proposals per round
    ahead_steps: int = 0  # draft steps queued beside a verify pass (drafting ahead), not in draft_steps or draft_seconds
    ahead_rounds: int = 0  # rounds whose proposals were drafted during the verify pass before

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_pass(self) -> float | None:
        """New tokens per weight pass of the target (verify passes and plain steps)."""
        passes = self.passes + self.plain_steps
        return (self.accepted + passes) / passes if passes else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance": self.acceptance, "tokens_per_pass": self.tokens_per_pass}


def best_k(acceptance: float, draft_seconds: float, verify_seconds: float, most: int, ahead: bool = False) -> int:
    """The proposals per round that give the most tokens per second, where each proposal is
    kept with probability ``acceptance`` (the round ending at the first one that is not), a
    draft step costs ``draft_seconds`` and a verify pass ``verify_seconds``: a round of k
    proposals yields 1 + a + ... + a^k tokens for one pass and k + a^k draft steps (after a
    round that kept every proposal, the draft first catches up on the last one).

    0 where plain decode is faster than every k. A plain token is taken to cost a verify pass:
    where the weights stream, a pass over k + 1 positions costs what a pass over one does
    (measured on an H200: 1.00 x at the floor and at 50 %, 1.10 x with every weight resident).
    A draft that costs about what the target's step costs (a small model whose decode is bound
    by its kernels' launches, not by its bytes) does not pay.

    ``ahead``: the draft drafts the next round during each verify pass (``speculate``), its
    k + 1 steps beside the pass; that round's proposals are ready where every proposal was
    kept and the draft's guess at the target's own token was right (taken as a^(k + 1)), and
    are drafted again, k steps after the pass, where not."""
    a = min(max(acceptance, 0.0), 1.0)

    def rate(k: int) -> float:
        tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        if ahead:
            ready = a ** (k + 1)
            return tokens / (max(verify_seconds, (k + 1) * draft_seconds) + (1 - ready) * k * draft_seconds)
        return tokens / ((k + a**k) * draft_seconds + verify_seconds)

    best = max(range(1, most + 1), key=rate)
    return best if rate(best) > 1.0 / verify_seconds else 0


def _next_k(stats: SpeculationStats, most: int, ahead: bool = False) -> int:
    """k for the next round from what the rounds so far measured (``most`` until two ran); 0:
    decode plainly from here on."""
    if stats.passes < 2 or stats.drafted == 0 or stats.draft_steps == 0:
        return most
    acceptance = stats.accepted / (stats.accepted + stats.rejections) if stats.accepted + stats.rejections else 1.0
    return best_k(acceptance, stats.draft_seconds / stats.draft_steps, stats.verify_seconds / stats.passes, most, ahead)


def check_draft(target, draft) -> None:
    """Refuse a draft that cannot propose the target's tokens: another vocabulary, other
    end-of-sequence tokens, or a shorter cache."""
    if draft.vocab_size != target.vocab_size:
        raise GenerationError(f"the draft's vocabulary has {draft.vocab_size} ids, the target's {target.vocab_size}: a draft must share the target's tokenizer")
    if draft.eos_token_ids != target.eos_token_ids:
        raise GenerationError(f"the draft ends sequences at tokens {sorted(draft.eos_token_ids)}, the target at {sorted(target.eos_token_ids)}: "
                              "a draft must share the target's tokenizer")
    if draft.max_seq_len < target.max_seq_len:
        raise GenerationError(f"the draft's max_seq_len={draft.max_seq_len} is shorter than the target's {target.max_seq_len}; export the draft with at least as many positions")


class _RoundClock:
    """The draft's and the verify pass's time in a round, read once the round's tokens are on
    the host: CUDA events where the work is queued on a device (no sync of its own between
    the two), the host's clock where it runs as it is called."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if self.cuda else [0.0] * 3

    def mark(self, i: int) -> None:
        if self.cuda:
            self.marks[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def seconds(self) -> tuple[float, float]:
        """(draft, verify); call after the round's results were read."""
        if self.cuda:
            return self.marks[0].elapsed_time(self.marks[1]) / 1e3, self.marks[1].elapsed_time(self.marks[2]) / 1e3
        return self.marks[1] - self.marks[0], self.marks[2] - self.marks[1]


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, proposed: int, generator: torch.Generator) -> tuple[bool, int]:
    """The rule of speculative sampling at one position: ``proposed`` was drawn from the draft's
    distribution ``q``; keep it with probability min(1, p/q) under the target's ``p``, else draw
    from max(0, p - q), renormalised. The token that results is distributed as ``p``."""
    u = torch.rand((), generator=generator, device=p.device)
    if bool(u * q[proposed] <= p[proposed]):
        return True, proposed
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    if not bool(total > 0):  # p == q up to rounding: nothing to correct toward
        residual, total = p, p.sum()
    return False, check_drawn(int(draw(residual / total, generator)))


class Sampler:
    """Draws the draft's proposals and applies the rule, with one seeded generator on the device."""

    def __init__(self, params, device: torch.device):
        self.params = params
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return sampled_logprobs(logits.float(), self.params).exp()

    def draw(self, probabilities: torch.Tensor) -> int:
        return check_drawn(int(draw(probabilities, self.generator)))


def _token(value: int, device: torch.device) -> torch.Tensor:
    """``value`` as a [1, 1] tensor on ``device``, copied without waiting: a copy from pageable
    memory waits for the current stream, which after drafting ahead waits for the draft's
    steps, so the host would wait for them too before queuing the next round."""
    cuda = device.type == "cuda"
    return torch.tensor([[value]], dtype=torch.long, pin_memory=cuda).to(device, non_blocking=cuda)


def speculate(target, draft, first_token: int, position: int, k: int | None, max_new_tokens: int, eos, on_token, stats: SpeculationStats,
              sampler: Sampler | None = None, ahead: bool = False) -> list[int]:
    """Tokens after a prompt that both caches hold: ``first_token`` (the target's choice after
    the prompt, to go at ``position``) and the rest, k drafted and checked per round (k up to
    the target's verify width less one: a shorter round pads the verify call, whose padding's
    cache entries come after the round's and are overwritten like a rejection's). Greedy, or
    with ``sampler`` the speculative sampling rule: the draft samples its proposals, and the
    tokens kept are distributed as the target's sampling would draw them. ``k=None``: chosen
    each round by ``best_k`` from the acceptance and the draft and verify times so far.

    A greedy round queues the draft's k steps and the verify pass on the device, each step's
    input token the previous step's argmax and its position a slice of a device range, and
    reads the drafted and the chosen tokens in one copy at its end: one wait for the device
    per round, not one per drafted token.

    ``ahead`` (greedy): while the verify pass runs, the draft drafts the next round on a stream
    of its own, as if the pass keeps every proposal, from its own guess at the target's token
    after them. The pass waits for the weights' copies; the draft's steps fill that time. Where
    the pass kept every proposal and the guess was right, the next round starts at its verify
    pass; where not, what was drafted ahead is dropped, its cache entries overwritten as a
    rejection's are.
    """
    width = target.speculate_k + 1  # tokens the verify method takes
    fixed = k
    new = [first_token]
    if on_token:
        on_token(first_token)
    # inputs on the device: a host tensor given to a method is a copy from pageable memory, which waits for the device
    target_positions = torch.arange(target.max_seq_len + width, dtype=torch.long).to(target.device)
    draft_positions = target_positions.to(draft.device)
    last = _token(first_token, target.device)  # the last new token, on the target's device
    pending = [(last.to(draft.device), position)]  # tokens the draft has not yet seen, with their positions
    beside = _Beside(draft.device) if ahead and sampler is None else None
    ready: list[torch.Tensor] = []  # the next round's proposals, drafted during the last verify pass
    while len(new) < max_new_tokens and new[-1] not in eos:
        at = position + len(new) - 1  # where the last new token goes
        k = fixed if fixed is not None else _next_k(stats, width - 1, beside is not None)
        if k == 0 or at + width > target.max_seq_len:
            # plain decode from here on: speculation does not pay, or the verify call's
            # positions do not fit
            (logits,) = target.module.run_method(DECODE, [_token(new[-1], target.device), target_positions[at : at + 1]])
            if sampler is None:  # greedy: pipelined as a Generator without a draft decodes
                rest = decode_tokens(target._step, logits, at + 1, max_new_tokens - len(new), eos, on_token)
                stats.plain_steps += len(rest)
                return new + rest
            stats.plain_steps += 1
            accepted = [sampler.draw(sampler.probabilities(logits[0, -1]))]
        else:
            stats.k.append(k)
            clock = _RoundClock(target.device)
            clock.mark(0)
            if len(ready) >= k:  # drafted during the last pass: every proposal was kept, and the draft's guess at the target's token was right
                proposals, steps = ready[:k], 0
                stats.ahead_rounds += 1
            else:
                for token, where in pending:  # the last of these gives the first proposal
                    (logits,) = draft.module.run_method(DECODE, [token, draft_positions[where : where + 1]])
                proposals, steps = logits, len(pending) + k - 1
            if sampler is None:
                # draft the next round beside this pass where it would run (k + 1 positions fit after this round's)
                next_fits = beside is not None and at + k + 1 + width <= target.max_seq_len and len(new) + k + 1 < max_new_tokens
                n, drafts, after, last, guessed = _greedy_round(target, draft, proposals, last, k, at, width, draft_positions, target_positions, clock,
                                                                beside if next_fits else None)
                ready = _kept_ahead(beside, guessed, n == k, after)
                stats.ahead_steps += k + 1 if guessed else 0
            else:
                n, drafts, after, last = _sampled_round(target, draft, proposals, last, k, at, width, draft_positions, target_positions, clock, sampler)
            draft_seconds, verify_seconds = clock.seconds()
            stats.draft_seconds += draft_seconds
            stats.verify_seconds += verify_seconds
            stats.passes += 1
            stats.drafted += k
            stats.draft_steps += steps
            stats.accepted += n
            stats.rejections += n < k
            accepted = drafts[:n] + [after]
            # the draft saw the last token and drafts[:k - 1]; it has yet to see an accepted
            # drafts[k - 1] and the target's own token
            pending = ([(_token(drafts[k - 1], draft.device), at + k)] if n == k else []) + [(last.to(draft.device), at + n + 1)]
        for token in accepted:  # (once rounds fall back to plain decode they stay there: the draft is not needed again)
            new.append(token)
            if on_token:
                on_token(token)
            if len(new) == max_new_tokens or token in eos:
                return new
    return new


def _propose(draft, logits, at: int, k: int, positions) -> list[torch.Tensor]:
    """k greedy proposals for positions ``at + 1`` on, the first from ``logits`` (the draft's
    after the token at ``at``), each next from a draft step on the one before; [1, 1] tensors
    on the draft's device, nothing read back to the host."""
    proposals = [logits[0, -1].argmax().reshape(1, 1)]
    for i in range(1, k):
        (logits,) = draft.module.run_method(DECODE, [proposals[-1], positions[at + i : at + i + 1]])
        proposals.append(logits[0, -1].argmax().reshape(1, 1))
    return proposals


def _greedy_round(target, draft, proposals, last, k, at, width, draft_positions, target_positions, clock, beside=None):
    """k greedy proposals (``proposals``: drafted already, or the draft's logits to draft them
    from), checked by one verify pass after ``last``: (proposals kept, the k proposals, the
    target's token after the kept ones, that token as a [1, 1] tensor on the target's device,
    what was drafted ahead). ``beside``: the draft meanwhile drafts the next round as if every
    proposal is kept, on a stream of its own, from its guess at the target's token after them
    (a step on the last proposal, a step on that guess, and k - 1 more): (the guess, the next
    round's k proposals), or None."""
    if isinstance(proposals, torch.Tensor):
        proposals = _propose(draft, proposals, at, k, draft_positions)
    clock.mark(1)
    drafted = torch.cat(proposals, dim=1).to(target.device)
    ids = torch.cat([last, drafted] + [proposals[-1].to(target.device)] * (width - k - 1), dim=1)
    start = beside.mark() if beside is not None else None  # the draft's steps so far, not the pass queued next
    with beside.first() if beside is not None else contextlib.nullcontext():
        (logits,) = target.module.run_method(VERIFY, [ids, target_positions[at : at + width]])
    chosen = logits[0].argmax(-1)
    clock.mark(2)
    guessed = None
    if beside is not None:
        with beside.side(proposals[-1], start):
            (ahead_logits,) = draft.module.run_method(DECODE, [proposals[-1], draft_positions[at + k : at + k + 1]])
            guess = ahead_logits[0, -1].argmax().reshape(1, 1)
            beside.publish(guess)
            (ahead_logits,) = draft.module.run_method(DECODE, [guess, draft_positions[at + k + 1 : at + k + 2]])
            guessed = (guess, _propose(draft, ahead_logits, at + k + 1, k, draft_positions))
    values = torch.cat([drafted[0], chosen]).tolist()  # the round's one wait for the device (the verify pass's stream alone)
    drafts, choices = values[:k], values[k:]
    n = 0
    while n < k and drafts[n] == choices[n]:
        n += 1
    return n, drafts, choices[n], chosen[n : n + 1].reshape(1, 1), guessed


def _kept_ahead(beside, guessed, all_kept: bool, after: int) -> list[torch.Tensor]:
    """The next round's proposals drafted during the pass, where they stand: every proposal was
    kept and the draft guessed the target's token; else none. The draft's stream is joined
    either way, on the device: its steps wrote the draft's cache, which the next draft step
    reads. The host waits for the guess's step only: the next round is queued while the steps
    after it run, and its pass starts on the device when they end."""
    if guessed is None:
        return []
    guess, proposals = guessed
    beside.join([guess, *proposals])
    return proposals if all_kept and beside.read_guess(guess) == after else []


class _Beside:
    """A second stream on the draft's device for drafting ahead: its steps run beside the
    verify pass, whose stream waits for the weights' copies. On the CPU the steps run in line."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the verify pass's stream: where its kernels and the draft's are both ready, the
        # pass's go first, so that its weight copies, which wait for its kernels, stay on time
        self.urgent = torch.cuda.Stream(device, priority=-100) if device.type == "cuda" else None
        # the draft's guess at the target's token, copied for the host by the step that makes
        # it: the host reads it without waiting for the steps after it
        self.guess_host = torch.empty(1, dtype=torch.long, pin_memory=True) if device.type == "cuda" else None
        self.guess_copied = torch.cuda.Event() if device.type == "cuda" else None

    @contextlib.contextmanager
    def first(self):
        """Run the block ahead of the side's work: on a stream of the highest priority, in
        line with the main stream (after what it queued so far; what it queues next after
        the block)."""
        if self.urgent is None:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self.urgent.wait_stream(main)
        with torch.cuda.stream(self.urgent):
            yield
        main.wait_stream(self.urgent)

    def mark(self) -> torch.cuda.Event | None:
        """A point on the main stream that side work queued later starts after (and not after
        what the main stream queues meanwhile: the verify pass)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def side(self, read: torch.Tensor, start: torch.cuda.Event | None):
        """Queue the block's work on the side stream, after the main stream's work up to
        ``start`` (``mark``); ``read``, made on the main stream, is kept from reuse until the
        side's work ends."""
        if self.stream is None:
            yield
            return
        self.stream.wait_event(start)
        read.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def publish(self, guess: torch.Tensor) -> None:
        """Inside ``side``: copy ``guess`` [1, 1] for the host as soon as the step that makes it
        ends (``read_guess``)."""
        if self.stream is None:
            return
        self.guess_host.copy_(guess.reshape(1), non_blocking=True)
        self.guess_copied.record(self.stream)

    def read_guess(self, guess: torch.Tensor) -> int:
        """The published guess on the host, once its step ended: not after the side's later
        steps, which the next round's pass (or the draft's next steps) waits for on the device."""
        if self.stream is None:
            return int(guess)
        self.guess_copied.synchronize()
        return int(self.guess_host[0])

    def join(self, made: list[torch.Tensor]) -> None:
        """The main stream waits for the side's work; ``made`` on the side, read on the main."""
        if self.stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.stream)
        for tensor in made:
            tensor.record_stream(main)


def _sampled_round(target, draft, logits, last, k, at, width, draft_positions, target_positions, clock, sampler) -> tuple[int, list[int], int, torch.Tensor]:
    """k sampled proposals, kept or resampled by the rule; returns as ``_greedy_round`` does."""
    drafts, qs = [], []
    for i in range(k):
        if i:
            (logits,) = draft.module.run_method(DECODE, [_token(drafts[-1], draft.device), draft_positions[at + i : at + i + 1]])
        q = sampler.probabilities(logits[0, -1])
        drafts.append(sampler.draw(q))
        qs.append(q)
    clock.mark(1)
    ids = torch.tensor([[int(last.reshape(-1)[0]), *drafts] + [drafts[-1]] * (width - k - 1)], dtype=torch.long).to(target.device)
    (logits,) = target.module.run_method(VERIFY, [ids, target_positions[at : at + width]])
    n, token = 0, None
    while n < k:
        kept, token = accept_or_resample(sampler.probabilities(logits[0, n]), qs[n], drafts[n], sampler.generator)
        if not kept:
            break
        n += 1
        token = None
    if token is None:  # every proposal kept: the target's own token after them
        token = sampler.draw(sampler.probabilities(logits[0, k]))
    clock.mark(2)
    return n, drafts, token, _token(token, target.device)
