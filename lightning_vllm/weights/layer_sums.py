"""Per-layer fingerprints of weights, and the trainer's of what it sent (:class:`SentSums`).

A tensor's fingerprint is two integer sums over its values, each value taken as a float32
(bfloat16 and float16 values are float32 values): the sum of the values' bit patterns (exact, in
int64), and the sum of the bit patterns of their float32 squares (compared modulo 2**32). Integer
sums do not depend on the order in which they are added, and the square is computed per value, so
the fingerprints of a layer are *equal*, not merely close, when vLLM fuses q/k/v or gate/up into one
tensor, splits a tensor over tensor-parallel ranks (the ranks' sums add up), or pads a vocabulary
with zero rows (a zero's bit pattern is 0). Any one value that differs changes the first sum (a
sign flipped, by 2**31: a layer negated whole changes it unless exactly half its values were
negative); the second, not linear in the bit patterns, keeps changes that cancel in the first
(values one step up and as many one step down) from going unnoticed. So the two sides can be held
against each other after every push, across the two layouts, without moving a weight off its
device. A *layer* is what :func:`layer_of` names: a decoder layer's attention or MLP block or norm
(``model.layers.3.self_attn``), the embedding, the final norm, the head.

What they cost: on a CPU one compiled pass over the values (:func:`cpu_sums`, numba: 0.11 ns a bfloat16 value on one
thread, against 0.82 for the torch passes over cached chunks it replaced; numpy's passes where numba is missing); on
a GPU one fused Triton kernel reads each tensor once (``weights/gpu_sums.py``).

The engine's side (``held_sums.held_layer_sums``) runs inside vLLM's worker; the trainer asks for it through
``collective_rpc``, by a name our plugin gives every worker (``in_vllm/worker_methods.py``). Layers vLLM's CPU build
packs for oneDNN are fingerprinted where the loader wrote them, as they are packed (``packed_sums.py``).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from lightning_vllm.in_vllm.lora_adapters import ADAPTER_PREFIX
from lightning_vllm.weights.cpu_loops import compiled_loops

# The parts of a MoE block vLLM holds as modules of their own: each is a layer of its own here, so that a check
# names the routed experts (one fused tensor per projection in vLLM) apart from the router and the shared experts.
MOE_PARTS = frozenset({"experts", "gate", "shared_expert", "shared_experts", "shared_expert_gate"})
# A chunk, 1 MiB of float32 (about a core's L2 cache): what a conversion to the summed dtype writes before the loop
# reads it, and what numpy's passes (where numba is missing) read several times.
_CPU_CHUNK_ELEMENTS = 1 << 18
# Values summed as they are (no conversion): the most a loop is given at once (its 32-bit lanes count below 2**32).
_AS_IS_CHUNK_ELEMENTS = 1 << 30
# The squares' sums are compared modulo this: a CPU keeps them so (cheaper than exact).
SQUARES_MODULUS = 1 << 32


class LayerSums(NamedTuple):
    """The fingerprint of one layer's tensors as the trainer sent them: the sum of their float32 bit
    patterns, the sum of their squares' bit patterns, and whether every value was finite. (A named tuple: a check
    makes one per layer at every push, 131 on an 8B model.)

    Example::

        >>> sums = LayerSums(2, 5)
        >>> sums.matches(2, 5), sums.matches(2, 6)
        (True, False)
    """

    total: int
    squares: int
    finite: bool = True

    def matches(self, total: int, squares: int) -> bool:
        """Whether an engine's fingerprint equals this one: the bits' sums exactly, the squares' modulo 2**32."""
        return total == self.total and (squares - self.squares) % SQUARES_MODULUS == 0


def fused_experts(module: torch.nn.Module, parameter: torch.Tensor) -> int:
    """How many routed experts ``parameter`` holds as rows (vLLM's fused MoE ``w13_weight``, ``w2_weight``: each row
    is fingerprinted apart, as a layer ``<layer>.<expert>``), else 0."""
    experts = getattr(module, "global_num_experts", None)
    return experts if isinstance(experts, int) and parameter.dim() >= 2 and parameter.shape[0] == experts else 0


@functools.lru_cache(maxsize=1 << 17)  # (both sides name every tensor at every check: 291 of them on an 8B model)
def layer_of(name: str) -> str:
    """The layer a tensor belongs to, in names both sides share: the block after a decoder
    layer's index (in a MoE block, each routed expert, the router or the shared experts), else the
    module (LoRA's ``base_layer`` wrapper left out). vLLM holds a block's routed experts fused, one
    row of a tensor each: :func:`held_layer_sums` sums them row by row, as ``experts.{i}``.

    Example::

        >>> layer_of("model.layers.3.self_attn.q_proj.weight"), layer_of("model.layers.3.self_attn.qkv_proj.weight")
        ('model.layers.3.self_attn', 'model.layers.3.self_attn')
        >>> layer_of("model.layers.3.mlp.experts.7.up_proj.weight"), layer_of("model.layers.3.mlp.experts.w13_weight")
        ('model.layers.3.mlp.experts.7', 'model.layers.3.mlp.experts')
        >>> layer_of("model.embed_tokens.base_layer.weight"), layer_of("lm_head.weight")
        ('model.embed_tokens', 'lm_head')
    """
    parts = [part for part in name.split(".") if part != "base_layer"]
    for position, part in enumerate(parts[:-1]):
        if part.isdigit():
            end = position + 2
            if parts[end : end + 1] and parts[end] in MOE_PARTS:
                end += 2 if parts[end + 1 : end + 2] and parts[end + 1].isdigit() else 1  # (an expert's index)
            return ".".join(parts[: min(end, len(parts) - 1)])
    return ".".join(parts[:-1]) or name


@functools.lru_cache(maxsize=1 << 17)  # (named at every check, as layer_of)
def layer_key(layer: str) -> int:
    """``layer``'s name as a signed 64-bit integer, the same in every process (BLAKE2b): how a worker names a layer in
    sums it leaves in device memory for the trainer (``held_sums.LayerRows``).

    Example::

        >>> layer_key("model.layers.3.self_attn") == layer_key("model.layers.3.self_attn"), -(2**63) <= layer_key("x")
        (True, True)
    """
    return int.from_bytes(hashlib.blake2b(layer.encode(), digest_size=8).digest(), "little", signed=True)


def tensor_sums(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[bits, squares, not finite]`` of ``tensor``'s values, as int64 on its device (nothing synchronizes on a
    GPU): the sum of their float32 bit patterns, of their float32 squares' bit patterns (on a CPU, modulo 2**32),
    and how many squares are not finite (NaN or inf). With ``dtype``, of the values rounded to it first (as an
    engine serving that dtype holds them), a chunk at a time: no rounded copy of the whole tensor is made.

    On a CPU, chunks its cache holds are summed (:func:`cpu_sums`); on a GPU one fused kernel reads the tensor once
    (``weights/gpu_sums.device_sums``).

    Example::

        >>> one, minus_two, four = 0x3F800000, -0x40000000, 0x40800000  # float32 bit patterns, as int32
        >>> tensor_sums(torch.tensor([1.0, -2.0], dtype=torch.bfloat16)).tolist() == [one + minus_two, one + four, 0]
        True
    """
    flat = tensor.detach().reshape(-1)
    if flat.device.type == "cpu":
        return cpu_sums(flat, dtype)
    from lightning_vllm.weights.gpu_sums import device_sums  # (imports Triton: only where a GPU sums)

    # (A GPU's rounded copy is short-lived; the fused kernel then reads it once.)
    return device_sums(flat.to(dtype) if dtype is not None and dtype != flat.dtype else flat)


def sums_of_many(tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype | None]) -> list[torch.Tensor]:
    """:func:`tensor_sums` of each of ``tensors`` (rounded to its ``dtypes`` entry): on a GPU, those needing no
    rounding in one kernel launch per device and dtype (``weights/gpu_sums.py``); the others one by one."""
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    on_gpus: dict[torch.device, list[int]] = {}
    for position, (tensor, dtype) in enumerate(zip(tensors, dtypes)):
        # (FP8 values are summed one tensor at a time: the batched kernel reads 16- and 32-bit floats.)
        if tensor.is_cuda and dtype in (None, tensor.dtype) and tensor.is_contiguous() and tensor.element_size() > 1:
            on_gpus.setdefault(tensor.device, []).append(position)
    for positions in on_gpus.values():
        from lightning_vllm.weights.gpu_sums import batched_sums  # (imports Triton: only where a GPU sums)

        rows = batched_sums([tensors[position] for position in positions])  # (by address: no flat view needed)
        for position, row in zip(positions, rows.unbind(0) if rows is not None else ()):
            sums[position] = row
    return [found if found is not None else tensor_sums(t, dtype) for found, t, dtype in zip(sums, tensors, dtypes)]


class SentSums:
    """The fingerprints of every tensor a connection sent, kept across pushes: a changed-only push sends
    some tensors, and the engine holds the others from earlier pushes.

    :meth:`tally` is given each tensor as it goes on the wire (summed on its device, no sync);
    :meth:`commit` keeps the push's sums once it committed, :meth:`dropped` forgets them. A tensor that the
    trainer's model holds and leaves as it is until the push returns (``held``) is summed apart, from
    :meth:`sum_held_meanwhile` on, while the trainer otherwise waits for the engine to receive and load the push: on
    a thread of its own on a CPU (measured at 400M on 2 CPU cores: the check's cost 1.80x an unchecked push when
    summed after the commit), on a stream of their own in one launch per dtype on a GPU.

    Example::

        >>> sent = SentSums()
        >>> sent.tally("model.layers.0.mlp.up_proj.weight", torch.ones(2, 2))
        >>> sent.commit()
        >>> sent.by_layer()
        {'model.layers.0.mlp': LayerSums(total=4261412864, squares=4261412864, finite=True)}
    """

    def __init__(self) -> None:
        self.unverifiable: set[str] = set()  # layers the engine cannot verify (said once): not summed
        self._pending: dict[str, torch.Tensor] = {}
        self._later: dict[str, tuple[torch.Tensor, torch.dtype | None]] = {}  # held tensors, summed in commit()
        self._held: dict[str, tuple[int, int, int]] = {}  # bits, squares, not finite
        self._meanwhile: _HeldSumsMeanwhile | None = None  # the held tensors' sums, running beside the push
        self._read: list[list[int]] | None = None  # those sums, read while the engine's copies ran (read_meanwhile)

    def tally(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None, held: bool = False) -> None:
        """Count ``tensor``, rounded to ``dtype`` (the engine's serving dtype) when given, as sent under ``name``;
        ``held``: the model holds it, unchanged until the push returns (see the class docstring). A LoRA adapter's
        tensor, or one of a layer in :attr:`unverifiable`, is not counted."""
        if name.startswith(ADAPTER_PREFIX) or (self.unverifiable and layer_of(name) in self.unverifiable):
            return
        if held:
            self._pending.pop(name, None)
            self._later[name] = (tensor, dtype)
        else:
            self._later.pop(name, None)
            self._pending[name] = tensor_sums(tensor, dtype)

    def sum_held_meanwhile(self) -> None:
        """Start summing the held tensors now, before the push sends them (see the class docstring): on a thread if
        they are all on a CPU; on a GPU queued on a stream of their own (nothing waits for them until :meth:`commit`).
        The push holds them unchanged until it returns."""
        later = list(self._later.items())
        devices = {tensor.device for _, (tensor, _) in later}
        if len(devices) == 1:  # (a model over several GPUs is summed in commit())
            self._meanwhile = _HeldSumsMeanwhile(later, devices.pop())

    def read_meanwhile(self) -> None:
        """Read the held tensors' sums now, once they are done, if they were summed beside the push: while the
        engine's copies of a push that committed still run (``lightning_ipc``), so that :meth:`commit` finds them
        read. Waits for those sums alone. (An 8B push on an H100: 0.3 ms of the trainer's after its copies landed,
        docs/runs.md run 65.)"""
        if self._meanwhile is not None and self._read is None:
            summed = self._meanwhile.result(list(self._later.items()))
            self._read = sums_as_ints(summed) if summed is not None else None

    def commit(self, others: Mapping[str, Sequence[int]] | None = None) -> None:
        """The push committed: the engine now holds what was tallied (the held tensors summed: on a GPU in one
        launch; then one device sync). ``others``: the other trainer ranks' sums of their shares of the tensors
        tallied here (a push every rank sends a share of), added to this rank's."""
        meanwhile, self._meanwhile, read, self._read = self._meanwhile, None, self._read, None
        later = list(self._later.items())
        if read is None:
            summed = meanwhile.result(later) if meanwhile is not None else None
            if summed is None and later:
                summed = sums_of_many([t for _, (t, _) in later], [d for _, (_, d) in later])
            read = sums_as_ints(summed) if summed is not None else []
        names = [name for name, _ in later] + list(self._pending)
        rows = read + sums_as_ints(list(self._pending.values()))
        for name, (total, squares, not_finite) in zip(names, rows, strict=True):
            more = others.get(name, (0, 0, 0)) if others else (0, 0, 0)
            self._held[name] = (total + more[0], squares + more[1], not_finite + more[2])
        self._pending, self._later = {}, {}

    def dropped(self) -> None:
        """The push did not commit: what was tallied is not what the engine holds."""
        self._pending, self._later, self._meanwhile, self._read = {}, {}, None, None  # (a thread summing ends alone)

    def by_layer(self) -> dict[str, LayerSums]:
        """What the engine should hold, per layer (:func:`layer_of`)."""
        layers: dict[str, list[int]] = {}
        for name, (total, squares, not_finite) in self._held.items():  # (add_sums inlined: 291 tensors on an 8B)
            layer = layer_of(name)
            if (held := layers.get(layer)) is None:
                layers[layer] = [total, squares, not_finite]
            else:
                held[0], held[1], held[2] = held[0] + total, held[1] + squares, held[2] + not_finite
        return {
            layer: LayerSums(total, squares, finite=not not_finite)
            for layer, (total, squares, not_finite) in layers.items()
        }


class _HeldSumsMeanwhile:
    """The sums of held tensors (``(name, (tensor, dtype))``, :func:`sums_of_many`), computed while the pushing thread
    goes on. On a CPU on a thread of its own (the compiled loops release the GIL). On a GPU queued at once, from the
    pushing thread, on a stream of their own that waits for the pushing thread's (the optimizer step that wrote the
    tensors): the device reads them while the push's first calls go to the engine, and a wait for the pushing thread's
    stream (vLLM's senders sync it before they send) does not wait for the sums."""

    def __init__(self, later: list[tuple[str, tuple[torch.Tensor, torch.dtype | None]]], device: torch.device) -> None:
        self._later = later
        self._sums: torch.Tensor | list[torch.Tensor] | None = None  # one row per tensor
        self._thread: threading.Thread | None = None
        self._stream: torch.cuda.Stream | None = None
        if device.type != "cuda":
            self._thread = threading.Thread(target=self._run, name="lightning-vllm: sums of the weights sent")
            self._thread.daemon = True
            self._thread.start()
            return
        self._stream = torch.cuda.Stream(device)  # (from PyTorch's pool of streams)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            self._run()

    def _run(self) -> None:
        tensors, dtypes = [t for _, (t, _) in self._later], [d for _, (_, d) in self._later]
        try:
            rows = None
            if self._stream is not None and all(d in (None, t.dtype) for t, d in zip(tensors, dtypes)):
                from lightning_vllm.weights.gpu_sums import batched_sums  # (imports Triton: only where a GPU sums)

                # (One [tensors, 3] tensor, not a view a tensor: an 8B model's 291 took milliseconds to make and read.)
                rows = batched_sums(tensors)
            self._sums = rows if rows is not None else sums_of_many(tensors, dtypes)
        except Exception:  # noqa: BLE001  # (summed again where it is asked for, which raises then)
            self._sums = None

    def result(
        self, later: list[tuple[str, tuple[torch.Tensor, torch.dtype | None]]]
    ) -> torch.Tensor | list[torch.Tensor] | None:
        """The sums, one row per tensor, once computed (work on tensors held in memory: it ends), or ``None`` if they
        failed or were taken of other tensors than ``later``. On a GPU, the calling thread's stream waits for them."""
        if self._thread is not None:
            self._thread.join()
        same = [name for name, _ in later] == [name for name, _ in self._later]
        if self._stream is not None and self._sums is not None:
            current = torch.cuda.current_stream(self._stream.device)
            current.wait_stream(self._stream)
            # (Their memory is not reused until the calling stream has read them.)
            for sums in [self._sums] if isinstance(self._sums, torch.Tensor) else self._sums:
                sums.record_stream(current)
        return self._sums if same else None


def add_sums(sums: dict[str, list[int]], layer: str, values: Sequence[int]) -> None:
    """Add ``values`` (bits, squares, ...) to ``layer``'s in ``sums``."""
    totals = sums.setdefault(layer, [0] * len(values))
    for position, value in enumerate(values):
        totals[position] += value


def sums_as_ints(sums: torch.Tensor | list[torch.Tensor]) -> list[list[int]]:
    """Sums, one row per tensor (one tensor of rows, or rows that may sit on several devices: a model split over
    GPUs), read with one copy per device; the squares' modulo 2**32, as compared (a GPU kernel's add up in int32
    lanes, wrapping)."""
    if isinstance(sums, torch.Tensor):
        return [[bits, squares % SQUARES_MODULUS, *rest] for bits, squares, *rest in sums.tolist()]
    by_device: dict[torch.device, list[int]] = {}
    for position, values in enumerate(sums):
        by_device.setdefault(values.device, []).append(position)
    ints: list[list[int]] = [[] for _ in sums]
    for positions in by_device.values():
        for position, (bits, squares, *rest) in zip(positions, torch.stack([sums[p] for p in positions]).tolist()):
            ints[position] = [bits, squares % SQUARES_MODULUS, *rest]
    return ints


def cpu_sums(flat: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """:func:`tensor_sums` on a CPU: one compiled pass over the values (``cpu_loops.compiled_loops``), a chunk at a
    time, each chunk rounded to ``dtype`` first and held as float32 unless bfloat16 (buffers made once, where that is
    needed); values summed as they are, in chunks of up to 2**30 (the loops count in 32-bit lanes; calls on 2**18 chunks
    took 0.154 ns a bfloat16 value against 0.117 in one call)."""
    kept = flat.dtype if dtype is None else dtype
    short = kept == torch.bfloat16
    as_is = dtype in (None, flat.dtype) and kept in (torch.bfloat16, torch.float32)
    size = max(1, min(flat.numel(), _AS_IS_CHUNK_ELEMENTS if as_is else _CPU_CHUNK_ELEMENTS))
    rounded = None if as_is or kept in (torch.float32, torch.bfloat16, flat.dtype) else torch.empty(size, dtype=kept)
    values = None if as_is else torch.empty(size, dtype=torch.bfloat16 if short else torch.float32)
    loop = compiled_loops()[0 if short else 1]
    bits = squares = not_finite = 0
    for chunk in flat.split(size):
        if rounded is not None:
            chunk = rounded[: chunk.numel()].copy_(chunk)
        if values is not None:
            chunk = values[: chunk.numel()].copy_(chunk)
        found = loop(chunk.view(torch.int16 if short else torch.int32).numpy())
        bits, squares, not_finite = bits + int(found[0]), squares + int(found[1]), not_finite + int(found[2])
    return torch.tensor([bits << 16 if short else bits, squares % SQUARES_MODULUS, not_finite])
