"""Choosing the next token on the device: greedy, or sampled with temperature, top-k, top-p and a
repetition penalty from a seeded generator.

Every step runs as tensor ops on the logits' device, the token and its log-probability staying
there: the decode loop queues the next step before the host reads a token, as it does greedily.
The same seed gives the same tokens (one ``torch.Generator`` on the device, drawn once a step).
Greedy (the default) is ``argmax``, bitwise what it was before sampling existed.
"""

from __future__ import annotations

import dataclasses
import math

import torch

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


class SamplingError(ValueError):
    """A sampling parameter out of its range; the message names it."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature=0`` (the default) is greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # > 1 makes tokens already in the sequence less likely (CTRL's rule)
    seed: int | None = None

    def __post_init__(self):
        def number(name, low, high=math.inf, low_open=False):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
                bound = f"{'above' if low_open else 'at least'} {low}" + (f" and at most {high}" if high != math.inf else "")
                raise SamplingError(f"{name} must be a number {bound}, got {value!r}")

        number("temperature", 0.0)
        number("top_p", 0.0, 1.0, low_open=True)
        number("repetition_penalty", 0.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an int, 0 (every token) or more, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise SamplingError(f"seed must be an int from {SEED_RANGE[0]} to {SEED_RANGE[1]} or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax(self) -> bool:
        """Whether the token is the logits' own argmax: greedy with no penalty (top-k and top-p
        keep the likeliest token)."""
        return self.greedy and self.repetition_penalty == 1.0


def sampled_logprobs(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [vocab] that a token is drawn from, for one position's float scores:
    scaled by the temperature, cut to the top k, then to the smallest set reaching top_p."""
    scores = scores / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p  # keep the smallest prefix reaching top_p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, -math.inf))
    return torch.log_softmax(scores, dim=-1)


NO_TOKEN = -1  # what a draw gives where the logits hold no distribution (a NaN)


def draw(probabilities: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index [1] drawn from ``probabilities`` [n], or ``NO_TOKEN`` where they are not a
    distribution (a NaN or a negative), all on their device.

    ``torch.multinomial(probabilities, 1)`` draws by the same race (the largest p / q, each q
    exponential), so the same generator state gives the same index; but its input checks are
    assertions, on CUDA device-side ones that end the process's CUDA context. Here the check
    is one device op, and the host learns of a bad distribution when it reads the token
    (``check_drawn``)."""
    race = torch.empty_like(probabilities).exponential_(1, generator=generator)
    index = (probabilities / race).argmax().reshape(1)
    return torch.where((probabilities >= 0).all(), index, NO_TOKEN)


def check_drawn(token: int) -> int:
    """``token`` as read by the host, or ``SamplingError`` where the draw had no distribution."""
    if token == NO_TOKEN:
        raise SamplingError("the model's logits for this step hold a NaN (or the sampling settings left no token with a probability): "
                            "no token can be drawn; the weights or an overflow in the model's arithmetic are the likely cause")
    return token


class TokenChooser:
    """Chooses each next token from a step's last logits, on their device (``NO_TOKEN`` where
    they hold no distribution: the host's read of it raises, ``check_drawn``)."""

    def __init__(self, params: SamplingParams, device: torch.device, vocab_size: int, prompt: torch.Tensor):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        # tokens seen so far, for the repetition penalty (prompt included, as transformers does)
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[prompt.reshape(-1).to(device)] = True

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the token [1, 1], its log-probability under the distribution it was drawn from [1])
        for one position's logits [vocab]."""
        p = self.params
        scores = logits.float()
        if self.seen is not None:
            penalized = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            scores = torch.where(self.seen, penalized, scores)
        if p.greedy:
            token = scores.argmax().reshape(1)
            logprob = torch.log_softmax(scores, dim=-1)[token]
        else:
            logprobs = sampled_logprobs(scores, p)
            token = draw(logprobs.exp(), self.generator)
            logprob = logprobs[token.clamp(min=0)]  # a valid index where the draw gave NO_TOKEN
        if self.seen is not None:
            self.seen[token.clamp(min=0)] = True
        return token.reshape(1, 1), logprob.reshape(1)


# every sampling op at once: temperature, top-k, top-p and the repetition penalty
_WARM_UP = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=0)


def warm_up_sampling(logits: torch.Tensor) -> None:
    """Chooses one token from one position's logits [vocab] with every sampling op, and reads it.

    CUDA loads a kernel's code at its first launch: a load's warm-up that only decoded greedily
    would leave that one-time cost to the first sampled request's decode time (docs/design.md,
    sampling)."""
    chooser = TokenChooser(_WARM_UP, logits.device, logits.shape[-1], torch.zeros(1, dtype=torch.long))
    token, _ = chooser(logits.reshape(-1, logits.shape[-1])[-1])
    int(token)  # waits for every op queued before it
