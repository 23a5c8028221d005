"""The layer synchronization dictionary: validation, the default schedule, tables and a timeline.

``{layer i: (offload_fwd, offload_num, reload_fwd, reload_num)}``, layers 0..n-1 in forward
order, as Transformer Engine's CPU offload schedules them. Layer i is offloaded iff it is a key. Its
offload finishes, and its GPU memory is released, when layer ``offload_num`` begins its
forward (``offload_fwd``) or backward pass; its reload starts when layer ``reload_num`` begins
its forward (``reload_fwd``) or backward pass.

Points in a step are ordered ``fwd 0 < ... < fwd n-1 < bwd n-1 < ... < bwd 0``.
"""

from __future__ import annotations

import dataclasses
import warnings

SyncEntry = tuple[bool, int, bool, int]


class SyncDictError(ValueError):
    """A synchronization dictionary (or num_layers) that cannot be executed; names the layer."""


class NoOverlapWarning(UserWarning):
    """num_layers = model_layers - 1: one layer's activations on the GPU, no overlap possible."""


def point(fwd: bool, layer: int, model_layers: int) -> int:
    """Position of 'layer begins its forward (fwd) / backward pass' in a step."""
    return layer if fwd else 2 * model_layers - 1 - layer


def point_name(p: int, model_layers: int) -> str:
    return f"fwd {p}" if p < model_layers else f"bwd {2 * model_layers - 1 - p}"


def default_sync_dict(model_layers: int, num_layers: int, reload_ahead: int | None = None) -> dict[int, SyncEntry]:
    """Offload the first k of n layers; at most n-k layers' activations on the GPU.

    The default reloads layer i when layer n-k+i-1 begins its backward pass, as early as the
    n-k bound allows. The weight gradients made in the meantime then add to the peak.
    ``reload_ahead=r`` reloads layer i instead when layer i+r begins its backward pass, so
    that the peak stays near the forward's.
    """
    n, k = model_layers, num_layers
    if reload_ahead is not None and (isinstance(reload_ahead, bool) or not isinstance(reload_ahead, int) or reload_ahead < 1):
        raise SyncDictError(f"reload_ahead must be an int >= 1 (layers), got {reload_ahead!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SyncDictError(f"model_layers must be a positive int, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise SyncDictError(f"num_layers must be an int >= 0, got {k!r}")
    if k >= n:
        raise SyncDictError(
            f"num_layers={k} with model_layers={n}: at least one layer's activations must stay on the GPU "
            f"(num_layers <= {n - 1}, and <= {n - 2} for overlap)"
        )
    if k == n - 1 and k > 0:
        warnings.warn(
            f"num_layers={k} = model_layers - 1 leaves one layer's activations on the GPU: compute and "
            f"transfers cannot overlap; use num_layers <= {n - 2} for overlap",
            NoOverlapWarning,
            stacklevel=3,
        )
    if reload_ahead is None:
        return {i: (True, n - k + i, False, n - k + i - 1) for i in range(k)}
    return {i: (True, n - k + i, False, min(i + reload_ahead, n - 1)) for i in range(k)}


def fitted_sync_dict(sync: dict[int, SyncEntry], model_layers: int, backward_s: dict[int, float], reload_s: dict[int, float],
                     earliest: dict[int, SyncEntry] | None = None, margin: float = 1.15,
                     reload_bytes: dict[int, int] | None = None, headroom: dict[int, int] | None = None) -> dict[int, SyncEntry]:
    """``sync`` with each offloaded layer's reload moved to the latest backward point from which
    the reloads, one after another on the copy stream, still land before their layers' backward
    begins: the copies stay hidden, and the reloaded layers come back as late as that allows,
    which keeps them out of the backward's memory peak.

    ``backward_s[j]``: seconds of layer j's backward pass (every layer that ends before the last
    offloaded one begins); ``reload_s[i]``: seconds of offloaded layer i's copy back, scaled by
    ``margin``. A reload is never moved before its point in ``earliest`` (by default the n-k
    bound of ``default_sync_dict``), nor before its offload finishes; where even that cannot hide
    it, that earliest point is where it starts.

    With ``headroom`` (layer j -> bytes the device can hold beyond what the step holds anyway when
    layer j's backward begins, without raising the step's peak) and ``reload_bytes`` (offloaded
    layer i -> bytes its reload brings back), memory comes first: a reload is moved later, one
    point at a time down to one layer ahead, while the reloads under way at some point would
    exceed its headroom; the copies may then not be hidden. A reloaded layer counts from its
    reload's point until its own backward.
    """
    n = model_layers
    offloaded = sorted(sync)
    if not offloaded:
        return dict(sync)
    earliest = earliest if earliest is not None else default_sync_dict(n, len(offloaded))
    missing = [j for j in range(offloaded[0] + 1, n) if j not in backward_s] + [i for i in offloaded if i not in reload_s]
    if missing:
        raise SyncDictError(f"fitting reload points needs every layer's backward seconds and every offloaded layer's reload seconds; layer {missing[0]} has none")
    begins = {n - 1: 0.0}  # seconds from the start of the backward to where layer j's backward begins
    for j in range(n - 2, -1, -1):
        begins[j] = begins[j + 1] + backward_s.get(j + 1, 0.0)
    out = dict(sync)
    stream_free_until = float("inf")  # the reload after this one (a lower layer) starts here, at the latest
    for i in offloaded:  # the last reload needed first
        done = min(begins[i], stream_free_until)
        start = done - margin * reload_s[i]
        stream_free_until = start
        # the latest point j (the lowest layer) that begins no later than start
        candidates = [j for j in range(i, n) if begins[j] <= start]
        j = min(candidates) if candidates else n - 1
        first = max(point(earliest[i][2], earliest[i][3], n) if i in earliest else 0, point(sync[i][0], sync[i][1], n))
        p = max(point(False, j, n), first)
        fwd = p < n
        out[i] = (sync[i][0], sync[i][1], fwd, p if fwd else 2 * n - 1 - p)
    if headroom is not None:
        missing = [i for i in offloaded if reload_bytes is None or i not in reload_bytes]
        if missing:
            raise SyncDictError(f"fitting reload points to the headroom needs every offloaded layer's reload bytes; layer {missing[0]} has none")
        under_way: dict[int, int] = {}  # layer j -> bytes reloaded and not yet used when layer j's backward begins
        for i in reversed(offloaded):  # the copy stream's order: the first reload keeps its point first
            fwd, start = out[i][2], out[i][3]
            if fwd:
                continue
            while start > i + 1 and any(under_way.get(j, 0) + reload_bytes[i] > headroom.get(j, float("inf")) for j in range(i, start)):
                start -= 1
            for j in range(i, start):
                under_way[j] = under_way.get(j, 0) + reload_bytes[i]
            out[i] = (sync[i][0], sync[i][1], False, start)
    return validate_sync_dict(out, n)


def validate_sync_dict(sync: dict, model_layers: int) -> dict[int, SyncEntry]:
    n = model_layers
    if not isinstance(sync, dict):
        raise SyncDictError(f"synchronization_dict must be a dict {{layer: (offload_fwd, offload_num, reload_fwd, reload_num)}}, got {type(sync).__name__}")
    out = {}
    for layer, entry in sorted(sync.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else -1):
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise SyncDictError(f"synchronization_dict key {layer!r} is not a layer index in 0..{n - 1}")
        if not isinstance(entry, (tuple, list)) or len(entry) != 4:
            raise SyncDictError(f"layer {layer}: entry {entry!r} is not (offload_fwd, offload_num, reload_fwd, reload_num)")
        offload_fwd, offload_num, reload_fwd, reload_num = entry
        for name, value in (("offload_fwd", offload_fwd), ("reload_fwd", reload_fwd)):
            if not isinstance(value, bool):
                raise SyncDictError(f"layer {layer}: {name} must be a bool, got {value!r}")
        for name, value in (("offload_num", offload_num), ("reload_num", reload_num)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
                raise SyncDictError(f"layer {layer}: {name} must be a layer index in 0..{n - 1}, got {value!r}")
        finish = point(offload_fwd, offload_num, n)
        reload = point(reload_fwd, reload_num, n)
        if finish <= point(True, layer, n):
            raise SyncDictError(
                f"layer {layer}: offload would finish at {point_name(finish, n)}, before layer {layer}'s forward ends "
                f"(its activations are saved during its forward; finish at fwd {layer + 1} or later)"
            )
        if reload > point(False, layer, n):
            raise SyncDictError(
                f"layer {layer}: reload would start at {point_name(reload, n)}, after layer {layer}'s backward begins "
                f"(bwd {layer}); reload_num must be >= {layer} in the backward pass"
            )
        if reload < finish:
            raise SyncDictError(
                f"layer {layer}: reload would start at {point_name(reload, n)}, before its offload finishes at {point_name(finish, n)}"
            )
        out[layer] = (offload_fwd, offload_num, reload_fwd, reload_num)
    return out


@dataclasses.dataclass
class LayerRecord:
    layer: int
    saved_bytes: int = 0  # bytes of this layer's saved activations that the pass offloads
    kept_bytes: int = 0  # bytes it saves that stay on the GPU (parameters excluded)
    tensors: int = 0  # offloaded tensors (after view and duplicate folding)


@dataclasses.dataclass
class ActivationSchedule:
    """What the activation pass emitted for one compiled graph: dictionary and per-layer bytes."""

    model_layers: int
    sync: dict[int, SyncEntry]
    manual: bool = False
    layers: dict[int, LayerRecord] = dataclasses.field(default_factory=dict)

    def finish_point(self, layer: int) -> int | None:
        e = self.sync.get(layer)
        return None if e is None else point(e[0], e[1], self.model_layers)

    def reload_point(self, layer: int) -> int | None:
        e = self.sync.get(layer)
        return None if e is None else point(e[2], e[3], self.model_layers)

    def actions_at(self, p: int) -> tuple[list[int], list[int]]:
        """(layers released, layers whose reload starts) when the step reaches point p."""
        if self.manual:
            return [], []
        release = [i for i in self.sync if self.finish_point(i) == p]
        reload = [i for i in self.sync if self.reload_point(i) == p]
        return release, reload

    def rows(self) -> list[dict]:
        n = self.model_layers
        rows = []
        for i in range(n):
            rec = self.layers.get(i, LayerRecord(i))
            offloaded = i in self.sync
            rows.append({
                "layer": i,
                "offloaded": offloaded,
                "offloaded_bytes": rec.saved_bytes if offloaded else 0,
                "kept_bytes": rec.kept_bytes + (0 if offloaded else rec.saved_bytes),
                "tensors": rec.tensors if offloaded else 0,
                "offload_start": f"fwd {i} (as saved)" if offloaded else "",
                "offload_finish": ("manual" if self.manual else point_name(self.finish_point(i), n)) if offloaded else "",
                "reload_start": ("manual" if self.manual else point_name(self.reload_point(i), n)) if offloaded else "",
            })
        return rows

    def table(self) -> str:
        from tabulate import tabulate

        rows = self.rows()
        body = tabulate([list(r.values()) for r in rows], headers=["layer", "offloaded", "offloaded bytes", "kept bytes", "tensors", "offload start", "offload finish (release)", "reload start"])
        total = sum(r["offloaded_bytes"] for r in rows)
        return f"{body}\n\n{sum(1 for r in rows if r['offloaded'])} of {self.model_layers} layers offloaded, {total} bytes per step"

    def to_dict(self) -> dict:
        return {"model_layers": self.model_layers, "manual": self.manual, "sync": {str(k): list(v) for k, v in self.sync.items()}, "layers": self.rows()}

    def plot(self, path: str) -> None:
        """A timeline in the manner of Transformer Engine's offload scheduling figure: compute per layer, offload and reload spans."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = self.model_layers
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * 2 * n), 0.5 * n + 1.6))
        for i in range(n):
            y = n - 1 - i
            ax.broken_barh([(point(True, i, n), 1), (point(False, i, n), 1)], (y - 0.35, 0.7), facecolors="#9bbbd4", edgecolor="black", linewidth=0.5)
            if i in self.sync and not self.manual:
                start, finish, reload = point(True, i, n), self.finish_point(i), self.reload_point(i)
                ax.broken_barh([(start + 0.05, finish - start - 0.05)], (y + 0.36, 0.18), facecolors="#e07b39")
                ax.broken_barh([(reload, point(False, i, n) + 1 - reload)], (y - 0.54, 0.18), facecolors="#5aa469")
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"layer {n - 1 - y}" for y in range(n)])
        ax.set_xticks([p + 0.5 for p in range(2 * n)])
        ax.set_xticklabels([point_name(p, n) for p in range(2 * n)], rotation=45, fontsize=7)
        ax.set_xlim(0, 2 * n)
        ax.set_title(f"{len(self.sync)} of {n} layers offloaded: compute (blue), offload until release (orange), reload (green)")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
