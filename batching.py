"""Many sequences, one weight pass: a KV cache of slots, each sequence at its own position.

Streamed decode is bound by bytes: a step of B sequences moves the same weights as a step of
one. ``export(model, path, max_seq_len=..., max_batch_size=B)`` writes a program whose KV cache
holds B slots and whose methods take each row's slot and positions:

- ``prefill(ids [1, chunk], positions [1, chunk], slot [1])`` writes one sequence's prompt
  chunk into its slot and attends within it (``prefill_long`` the same for a long prompt's
  longer chunks, as ``hostswap.llm`` writes it);
- ``decode(ids [B, 1], positions [B, 1], slots [B])`` advances every slot by one token, each
  at its own position.

A sequence's keys and values land at its own positions (``index_put`` by slot and position)
and its attention mask admits its slot's positions up to its own: rows never see one another,
so a sequence's tokens do not depend on what else is in the batch, and a slot can be taken by
a new sequence between decode steps while the others go on (continuous batching). Positions
past a sequence's end hold stale or padding keys; they are masked until the sequence's own
write, which comes first, overwrites them. transformers' exportable static cache has one
``cache_position`` for the whole batch, so this cache is hostswap's own (``SlotCache``); the
model's attention, rotary embedding and layers are transformers' as they are.

``BatchGenerator`` runs such a program: ``generate`` takes a list of prompts, and ``add`` /
``step`` let a server admit and retire sequences at step boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch

from hostswap import kv_shapes, llm
from hostswap.llm import DECODE, GenerationError
from hostswap.prefill_chunks import next_call, padded
from hostswap.sampling import SamplingParams, TokenChooser, check_drawn, warm_up_sampling

MAX_BATCH_SIZE = llm.MAX_BATCH_SIZE


def _by_position(states: torch.Tensor) -> torch.Tensor:
    """[batch, heads, tokens, width] as [batch * tokens, heads, width]: one row per position written."""
    batch, heads, tokens, width = states.shape
    return states.permute(0, 2, 1, 3).reshape(batch * tokens, heads, width)


class SlotCache:
    """The per-layer key and value buffers, written at each row's slot and positions; handed to
    a transformers model as its ``past_key_values`` for one call."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor, every_slot: bool):
        self.keys, self.values, self.slots, self.positions, self.every_slot = keys, values, slots, positions, every_slot

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None):
        batch, _, tokens, _ = key_states.shape
        rows = self.slots[:, None].expand(batch, tokens).reshape(-1)
        at = self.positions.reshape(-1)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[rows, :, at] = _by_position(key_states)
        values[rows, :, at] = _by_position(value_states)  # of its own heads and width (DeepSeek-V3's differ from the keys')
        if self.every_slot:  # decode: row i is slot i, the whole cache is the batch's
            return keys, values
        return keys.index_select(0, self.slots), values.index_select(0, self.slots)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given

    def is_compileable(self) -> bool:
        return True


@functools.lru_cache(maxsize=None)
def _slot_cache_class() -> type:
    """``SlotCache`` as a transformers ``Cache`` (models may check ``isinstance``), made when
    transformers is first needed."""
    from transformers.cache_utils import Cache

    return type("TransformersSlotCache", (SlotCache, Cache), {})


def attention_masks(config, positions: torch.Tensor, max_len: int):
    """Boolean masks [rows, 1, tokens, max_len]: a row sees its slot's positions up to its own
    (within the sliding window for the layers that have one); a dict by layer type where full
    and sliding layers mix, as transformers' models take it."""
    j = torch.arange(max_len, device=positions.device)[None, None, None, :]
    at = positions[:, None, :, None]
    full = j <= at
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())
    if not window or window >= max_len or (types and "sliding_attention" not in types):
        return full
    sliding = full & (j > at - window)
    if not types or types == {"sliding_attention"}:
        return sliding
    return {"full_attention": full, "sliding_attention": sliding}


def _cache_shapes(model) -> list[kv_shapes.LayerCacheShape]:
    """Each layer's heads and widths as its attention writes them (hostswap/kv_shapes.py);
    the config's where transformers has no static-cache module to trace them with."""
    try:
        return llm.cache_shapes(model)
    except GenerationError:
        from transformers.integrations.executorch import get_head_shapes

        heads, head_dim = get_head_shapes(model.config)
        layers = model.config.num_hidden_layers
        heads = heads if isinstance(heads, list) else [heads] * layers
        head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * layers
        return [kv_shapes.LayerCacheShape(h, d, h, d) for h, d in zip(heads, head_dim)]


class SlotDecoder(torch.nn.Module):
    """A transformers causal LM over a ``SlotCache`` of ``slots`` x ``max_len`` positions."""

    def __init__(self, model, slots: int, max_len: int):
        super().__init__()
        self.model, self.slots, self.max_len = model, slots, max_len
        shapes = _cache_shapes(model)
        self.layers = len(shapes)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        for i, shape in enumerate(shapes):
            self.register_buffer(f"key_cache_{i}", torch.zeros(slots, shape.key_heads, max_len, shape.key_dim, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"value_cache_{i}", torch.zeros(slots, shape.value_heads, max_len, shape.value_dim, dtype=dtype, device=device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows, tokens = input_ids.shape
        cache = _slot_cache_class()([getattr(self, f"key_cache_{i}") for i in range(self.layers)],
                                    [getattr(self, f"value_cache_{i}") for i in range(self.layers)],
                                    slots, positions, every_slot=rows == self.slots and tokens == 1)
        masks = attention_masks(self.model.config, positions, self.max_len)
        return self.model(input_ids=input_ids, position_ids=positions, attention_mask=masks, past_key_values=cache, use_cache=True).logits


def export_programs(model, *, max_seq_len: int, max_batch_size: int, prefill_chunk: int | None = None, long_prefill_chunk: int | str | None = llm.AUTO,
                    prefetch_depth: int = 1, gather_from_host: bool = True, progress: Callable[[str], None] | None = None,
                    device: str = "cpu") -> tuple[dict, dict]:
    """The probed ``prefill`` (and ``prefill_long``, as ``hostswap.llm.export`` writes it) and
    ``decode`` programs of a batched export, and their constants."""
    from hostswap.passes import apply_weight_offload

    llm._check_positive_int("max_seq_len", max_seq_len)
    llm._check_positive_int("max_batch_size", max_batch_size)
    prefills = llm.check_prefill_chunks(prefill_chunk, long_prefill_chunk, max_seq_len)
    say = progress or (lambda _msg: None)
    llm.prepare_for_export(model)
    decoder = SlotDecoder(model, max_batch_size, max_seq_len)
    programs = {}
    for name, rows, tokens in (*((method, 1, chunk) for method, chunk in prefills.items()), (DECODE, max_batch_size, 1)):
        say(f"exporting {name} ({rows} x {tokens} tokens)")
        ids = torch.zeros(rows, tokens, dtype=torch.long, device=device)
        positions = torch.arange(tokens, dtype=torch.long, device=device)[None].expand(rows, tokens).contiguous()
        slots = torch.arange(rows, dtype=torch.long, device=device)
        with torch.no_grad():
            try:
                ep = torch.export.export(decoder, (ids, positions, slots), strict=False)
            except Exception as e:  # noqa: BLE001 - named for the user, with what failed
                raise GenerationError(f"{type(model).__name__} did not export with a slotted cache: {type(e).__name__}: {str(e).splitlines()[0]}") from e
            llm.reset_state(ep)
        programs[name] = apply_weight_offload(ep, prefetch_depth=prefetch_depth, gather_from_host=gather_from_host)
    eos = llm._eos_ids(model)
    vocab = model.get_input_embeddings().num_embeddings
    constants = {llm.MAX_SEQ_LEN: max_seq_len, **llm.prefill_constants(prefills), llm.VOCAB_SIZE: vocab, MAX_BATCH_SIZE: max_batch_size,
                 **({llm.EOS_TOKEN_IDS: eos} if eos else {})}
    return programs, constants


def export(model, path: str | os.PathLike, *, max_seq_len: int, max_batch_size: int, **options) -> tuple[str, str]:
    """Write ``<path>.pte`` and ``<path>.ptd`` for ``max_batch_size`` sequences at once."""
    from hostswap.passes import save

    programs, constants = export_programs(model, max_seq_len=max_seq_len, max_batch_size=max_batch_size, **options)
    return save(programs, path, constant_methods=constants, progress=options.get("progress"))


def is_batched(pte_path) -> bool:
    """Whether the program at ``pte_path`` was written by ``export(..., max_batch_size=B)``."""
    from hostswap.schedules.pte_program import constant_method_outputs, read_program

    return constant_method_outputs(read_program(os.fspath(pte_path)), MAX_BATCH_SIZE) is not None


@dataclasses.dataclass
class Sequence:
    """One sequence in a slot: its tokens so far and when it ends."""

    slot: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset
    chooser: TokenChooser | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    prefilled: int = 0  # prompt tokens in the cache so far

    @property
    def decoding(self) -> bool:
        return bool(self.tokens) and not self.finished

    @property
    def position(self) -> int:
        """Where its next token's key goes: after the prompt and every new token but the last."""
        return len(self.prompt) + len(self.tokens) - 1

    def take(self, token: int) -> None:
        self.tokens.append(token)
        self.finished = len(self.tokens) >= self.max_new_tokens or token in self.eos


class BatchGenerator:
    """A program written by ``export(..., max_batch_size=B)``: up to B sequences decoded
    together, each joining and leaving at step boundaries."""

    def __init__(self, pte_path, data_path=None, *, weight_offload_budget_mb: float | str = "auto", device="cuda", policy: str = "planned",
                 cuda_graph: bool | None = None, **module_options):
        from hostswap.runtime import Module
        from hostswap.runtime.module import check_device_argument
        from hostswap.schedules.pte_program import constant_method_outputs

        self.device = check_device_argument(device)
        graphed = self.device.type == "cuda" and policy == "planned" and cuda_graph is not False
        # by default the decode step is graphed unless weights come from the disk (then eager)
        module_options.setdefault("cuda_graph_where_possible", cuda_graph is None)
        self.module = Module(pte_path, data_path, weight_offload_budget_mb=weight_offload_budget_mb, device=self.device, policy=policy,
                             cuda_graph=[DECODE] if graphed else False, **module_options)
        constants = {name: constant_method_outputs(self.module.program, name)
                     for name in (MAX_BATCH_SIZE, llm.MAX_SEQ_LEN, llm.PREFILL_CHUNK, llm.LONG_PREFILL_CHUNK, llm.VOCAB_SIZE, llm.EOS_TOKEN_IDS)}
        if constants[MAX_BATCH_SIZE] is None:
            self.module.close()
            raise GenerationError(f"{pte_path} is not a batched program: write it with hostswap.batching.export(..., max_batch_size=B), or run it with hostswap.llm.Generator")
        try:
            from hostswap.tensor_parallel import program_ranks

            self.tensor_parallel = program_ranks(self.module)  # (rank, world), checked against this process group
        except BaseException:
            self.module.close()
            raise
        self.max_batch_size = constants[MAX_BATCH_SIZE][0]
        self.max_seq_len = constants[llm.MAX_SEQ_LEN][0]
        self.prefill_chunk = constants[llm.PREFILL_CHUNK][0]
        self.long_prefill_chunk = constants[llm.LONG_PREFILL_CHUNK][0] if constants[llm.LONG_PREFILL_CHUNK] else None
        try:  # method -> tokens a call takes
            self.prefill_chunks = llm.loaded_prefill_methods(self.module, self.prefill_chunk, self.long_prefill_chunk, self.max_seq_len, "hostswap.batching.export")
        except GenerationError:
            self.module.close()
            raise
        self.vocab_size = constants[llm.VOCAB_SIZE][0]
        self.eos_token_ids = frozenset(constants[llm.EOS_TOKEN_IDS] or ())
        self.slots: list[Sequence | None] = [None] * self.max_batch_size
        try:
            # one-time costs (lazy initialisation, the decode graph's capture) before the first request
            for method, chunk in self.prefill_chunks.items():
                self.module.run_method(method, [torch.zeros(1, chunk, dtype=torch.long), torch.arange(chunk)[None], torch.zeros(1, dtype=torch.long)])
            every = torch.arange(self.max_batch_size)
            (logits,) = self.module.run_method(DECODE, [torch.zeros(self.max_batch_size, 1, dtype=torch.long), torch.zeros(self.max_batch_size, 1, dtype=torch.long), every],
                                               live_rows=torch.ones(self.max_batch_size, dtype=torch.bool))
            warm_up_sampling(logits[0])  # the sampling kernels' first launch, not the first sampled request's
            self.module.reset_state()
        except BaseException:
            self.module.close()
            raise

    # --- one sequence in, one step for all ---------------------------------------------------
    def free_slots(self) -> int:
        return sum(s is None for s in self.slots)

    def check_prompt(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise GenerationError("a prompt is empty: give at least one token")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise GenerationError(f"a prompt holds token id {bad!r}, outside the model's vocabulary of {self.vocab_size} ids")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise GenerationError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the program's max_seq_len={self.max_seq_len}")

    def add(self, prompt: list[int], max_new_tokens: int, *, eos_token_id=None, sampling: SamplingParams | None = None) -> Sequence:
        """Prefill ``prompt`` into a free slot (chunk by chunk) and choose its first token."""
        sequence = self.begin(prompt, max_new_tokens, eos_token_id=eos_token_id, sampling=sampling)
        while not self.prefill_next(sequence):
            pass
        return sequence

    def begin(self, prompt: list[int], max_new_tokens: int, *, eos_token_id=None, sampling: SamplingParams | None = None) -> Sequence:
        """Take a free slot for ``prompt``; ``prefill_next`` then runs its chunks, one a call."""
        self.check_prompt(prompt, max_new_tokens)
        slot = next((i for i, s in enumerate(self.slots) if s is None), None)
        if slot is None:
            raise GenerationError(f"all {self.max_batch_size} slots are taken: wait for a sequence to finish")
        eos = self.eos_token_ids if eos_token_id is None else frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        sampling = sampling or SamplingParams()
        ids = torch.tensor([prompt], dtype=torch.long)
        chooser = None if sampling.argmax else TokenChooser(sampling, self.device, self.vocab_size, ids)
        sequence = Sequence(slot, list(prompt), max_new_tokens, eos, chooser)
        self.slots[slot] = sequence
        return sequence

    def prefill_next(self, sequence: Sequence) -> bool:
        """Run ``sequence``'s next prompt chunk through its slot; after the last, choose its
        first token. Returns whether its prompt is all in."""
        call = next_call(sequence.prefilled, len(sequence.prompt), self.prefill_chunks, self.max_seq_len)
        chunk = self.prefill_chunks[call.method]
        piece = padded(torch.tensor([sequence.prompt[call.start : call.end]], dtype=torch.long), chunk)
        positions = torch.arange(call.start, call.start + chunk, dtype=torch.long)[None]
        (logits,) = self.module.run_method(call.method, [piece, positions, torch.tensor([sequence.slot], dtype=torch.long)])
        sequence.prefilled = call.end
        if sequence.prefilled < len(sequence.prompt):
            return False
        sequence.take(self._choose(sequence, logits[0, call.tokens - 1]))
        return True

    def step(self) -> list[Sequence]:
        """One decode step for every sequence in a slot; returns those that took a token.
        Finished sequences leave their slots."""
        active = [s for s in self.slots if s is not None and s.decoding]
        if active:
            # The program steps every slot, and each row writes its key and value at its
            # position. An empty slot's row writes at 0, which a sequence that takes the slot
            # overwrites first. A slot whose prompt is still coming in chunks holds its keys
            # from 0 on: its row writes at the last position, which no sequence's tokens fill
            # (a prompt and its new tokens but the last fill at most max_seq_len - 1
            # positions; only padding lands there) and none attends to. Rows of no sequence
            # taking tokens read no routed experts (``live_rows``): an MoE step moves its live
            # rows' experts alone.
            ids = torch.zeros(self.max_batch_size, 1, dtype=torch.long)
            positions = torch.tensor([[0 if s is None else self.max_seq_len - 1] for s in self.slots], dtype=torch.long)
            live = torch.zeros(self.max_batch_size, dtype=torch.bool)
            for s in active:
                ids[s.slot, 0], positions[s.slot, 0], live[s.slot] = s.tokens[-1], s.position, True
            (logits,) = self.module.run_method(DECODE, [ids, positions, torch.arange(self.max_batch_size)], live_rows=live)
            greedy = [s for s in active if s.chooser is None]
            if greedy:
                rows = torch.tensor([s.slot for s in greedy], device=logits.device)
                for s, token in zip(greedy, logits[rows, -1].argmax(-1).tolist()):
                    s.take(token)
            for s in active:
                if s.chooser is not None:
                    s.take(self._choose(s, logits[s.slot, -1]))
        self._free_finished()
        return active

    def _free_finished(self) -> None:
        for i, s in enumerate(self.slots):
            if s is not None and s.finished:
                self.slots[i] = None

    def release(self, sequence: Sequence) -> None:
        """Free ``sequence``'s slot now (its client went away)."""
        sequence.finished = True
        if self.slots[sequence.slot] is sequence:
            self.slots[sequence.slot] = None

    def _choose(self, sequence: Sequence, logits: torch.Tensor) -> int:
        if sequence.chooser is None:
            return int(logits.argmax())
        token, _ = sequence.chooser(logits)
        return check_drawn(int(token))

    # --- a list of prompts -------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens, *, eos_token_id=None, sampling: SamplingParams | list | None = None) -> list[list[int]]:
        """New tokens of each prompt (a list of token-id lists or 1-d tensors), without padding:
        sequences fill the slots, and each one finished makes room for the next."""
        prompts = [p.reshape(-1).tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
        lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(lengths) != len(prompts) or len(samplings) != len(prompts):
            raise GenerationError(f"{len(prompts)} prompts, {len(lengths)} max_new_tokens and {len(samplings)} sampling parameters: give one each")
        for prompt, n in zip(prompts, lengths):
            self.check_prompt(prompt, n)
        waiting = list(range(len(prompts)))
        running: dict[int, Sequence] = {}
        out: list[list[int]] = [[] for _ in prompts]
        while waiting or running:
            while waiting and self.free_slots():
                i = waiting.pop(0)
                running[i] = self.add(prompts[i], lengths[i], eos_token_id=eos_token_id, sampling=samplings[i])
            self.step()
            for i in [i for i, s in running.items() if s.finished]:
                out[i] = running.pop(i).tokens
        return out

    def memory_report(self) -> str:
        """Device memory by kind, as loaded."""
        m = self.module.stats
        return (f"{self.device}: {self.max_batch_size} sequence slots; weights {m['budget_bytes'] / 2**20:.1f} MiB (budget), "
                f"KV cache {m['state_bytes'] / 2**20:.1f} MiB, activations {m['activation_arena_bytes'] / 2**20:.1f} MiB; "
                f"host memory pinned for streaming {m['pinned_host_bytes'] / 2**20:.1f} MiB")

    def close(self) -> None:
        self.module.close()

    def __enter__(self) -> "BatchGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
