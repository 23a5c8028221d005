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

import dataclasses
import time

import torch

from hostswap.llm import DECODE, VERIFY, GenerationError


@dataclasses.dataclass
class SpeculationStats:
    """What the last speculative ``generate`` measured."""

    passes: int = 0  # verify passes of the target
    plain_steps: int = 0  # target decode steps where k + 1 positions did not fit
    drafted: int = 0
    accepted: int = 0  # drafted tokens the target agreed with
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rejections: int = 0  # rounds that ended at a proposal the target did not keep
    k: list[int] = dataclasses.field(default_factory=list)  # proposals per round

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


def best_k(acceptance: float, draft_seconds: float, verify_seconds: float, most: int) -> int:
    """The proposals per round that give the most tokens per second, where each proposal is
    kept with probability ``acceptance`` (the round ending at the first one that is not), a
    draft token costs ``draft_seconds`` and a verify pass ``verify_seconds``: a round of k
    proposals yields 1 + a + ... + a^k tokens for k drafts and one pass."""
    a = min(max(acceptance, 0.0), 1.0)

    def rate(k: int) -> float:
        tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        return tokens / (k * draft_seconds + verify_seconds)

    return max(range(1, most + 1), key=rate)


def _next_k(stats: SpeculationStats, most: int) -> int:
    """k for the next round from what the rounds so far measured (``most`` until two ran)."""
    if stats.passes < 2 or stats.drafted == 0:
        return most
    acceptance = stats.accepted / (stats.accepted + stats.rejections) if stats.accepted + stats.rejections else 1.0
    return best_k(acceptance, stats.draft_seconds / stats.drafted, stats.verify_seconds / stats.passes, most)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    return False, int(torch.multinomial(residual / total, 1, generator=generator))


class Sampler:
    """Draws the draft's proposals and applies the rule, with one seeded generator on the device."""

    def __init__(self, params, device: torch.device):
        from hostswap.sampling import sampled_logprobs

        self.params, self._logprobs = params, sampled_logprobs
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return self._logprobs(logits.float(), self.params).exp()

    def draw(self, probabilities: torch.Tensor) -> int:
        return int(torch.multinomial(probabilities, 1, generator=self.generator))


def speculate(target, draft, first_token: int, position: int, k: int | None, max_new_tokens: int, eos, on_token, stats: SpeculationStats,
              sampler: Sampler | None = None) -> list[int]:
    """Tokens after a prompt that both caches hold: ``first_token`` (the target's choice after
    the prompt, to go at ``position``) and the rest, k drafted and checked per round (k up to
    the target's verify width less one: a shorter round pads the verify call, whose padding's
    cache entries come after the round's and are overwritten like a rejection's). Greedy, or
    with ``sampler`` the speculative sampling rule: the draft samples its proposals, and the
    tokens kept are distributed as the target's sampling would draw them. ``k=None``: chosen
    each round by ``best_k`` from the acceptance and the draft and verify times so far."""
    width = target.speculate_k + 1  # tokens the verify method takes
    fixed = k
    new = [first_token]
    if on_token:
        on_token(first_token)
    pending = [(first_token, position)]  # tokens the draft has not yet seen, with their positions
    while len(new) < max_new_tokens and new[-1] not in eos:
        at = position + len(new) - 1  # where the last new token goes
        if at + width > target.max_seq_len:  # the verify call's positions do not fit: plain decode
            (logits,) = target.module.run_method(DECODE, [torch.tensor([[new[-1]]]), torch.tensor([at])])
            row = logits[0, -1]
            token = int(row.argmax()) if sampler is None else sampler.draw(sampler.probabilities(row))
            stats.plain_steps += 1
            accepted = [token]
        else:
            k = fixed if fixed is not None else _next_k(stats, width - 1)
            stats.k.append(k)
            start = time.perf_counter()

            def propose(logits) -> tuple[int, torch.Tensor | None]:
                row = logits[0, -1]
                if sampler is None:
                    return int(row.argmax()), None
                q = sampler.probabilities(row)
                return sampler.draw(q), q

            for token, where in pending:  # the last of these gives the first draft
                (logits,) = draft.module.run_method(DECODE, [torch.tensor([[token]]), torch.tensor([where])])
            drafts, qs = zip(*[propose(logits)])
            drafts, qs = list(drafts), list(qs)
            for i in range(1, k):
                (logits,) = draft.module.run_method(DECODE, [torch.tensor([[drafts[-1]]]), torch.tensor([at + i])])
                token, q = propose(logits)
                drafts.append(token)
                qs.append(q)
            _sync(draft.device)
            middle = time.perf_counter()
            ids = [new[-1], *drafts] + [drafts[-1]] * (width - k - 1)
            (logits,) = target.module.run_method(VERIFY, [torch.tensor([ids]), torch.arange(at, at + width)])
            n, last = 0, None
            if sampler is None:
                chosen = logits[0].argmax(-1).tolist()
                while n < k and drafts[n] == chosen[n]:
                    n += 1
                last = chosen[n]
            else:
                while n < k:
                    kept, token = accept_or_resample(sampler.probabilities(logits[0, n]), qs[n], drafts[n], sampler.generator)
                    if not kept:
                        last = token
                        break
                    n += 1
                if last is None:  # every proposal kept: the target's own token after them
                    last = sampler.draw(sampler.probabilities(logits[0, k]))
            stats.draft_seconds += middle - start
            stats.verify_seconds += time.perf_counter() - middle
            stats.passes += 1
            stats.drafted += k
            stats.accepted += n
            stats.rejections += n < k
            accepted = drafts[:n] + [last]
            # the draft saw the last token and drafts[:k - 1]; it has yet to see an accepted
            # drafts[k - 1] and the target's own token
            pending = ([(drafts[k - 1], at + k)] if n == k else []) + [(last, at + n + 1)]
        for token in accepted:  # (once rounds fall back to plain decode they stay there: the draft is not needed again)
            new.append(token)
            if on_token:
                on_token(token)
            if len(new) == max_new_tokens or token in eos:
                return new
    return new
