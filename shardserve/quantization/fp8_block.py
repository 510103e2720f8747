"""FP8 checkpoints with block-wise scales (`quantization_config.weight_block_size`, e.g. [128, 128]:
Qwen3-*-FP8, DeepSeek-V3): each linear's E4M3 `weight` comes with `weight_scale_inv`, one fp32
multiplier per block of BN output rows x BK inputs (edge blocks partial).

- Loading: the scale grid is spread to one row per output row as it loads ([N, ceil(K / BK)]), so
  fused q/k/v and gate/up parts and tensor-parallel row shards cut it exactly where they cut the
  weight, wherever they start. A row-parallel layer's input shard must start on a block boundary
  (its inputs per rank a multiple of BK), or the layer is refused when it is built.
- CUDA (compute capability 8.9+): the weight stays E4M3 (half the bytes of bf16) and the scales
  compact again: `weight_scale_inv` [R, ceil(K / BK)] holds the distinct consecutive rows and
  `scale_row` [N] points each output row at its own (kernels/quant/triton_fp8_block.py). Decode
  batches (up to 16 rows) run on its Triton GEMVs, which widen the weights in registers against the
  16-bit activations (W8A16), gate_up with its SiLU-and-mul in the same kernel. Prefill chunks run
  on cuBLAS's block-scaled FP8 matmul (W8A8, activations scaled per token and 128 inputs) where
  the layer allows it (128 x 128 blocks on 128-row boundaries; Hopper), else on Triton output tiles
  up to 256 rows and past that on cuBLAS after dequantizing the weight into a 16-bit temporary.
- Elsewhere (the CPU, older GPUs): the weight is widened once after loading into the layer's dtype
  (q * s in fp32, rounded once), so every CPU kernel runs unchanged on the checkpoint's values.
- MoE experts of such a checkpoint keep E4M3 with their block scales too (quantization/fp8_block_moe.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.kernels.cpu.decoder_stack import StackLinear, panels_linear
from shardserve.kernels.quant import reference, triton_fp8_block, tuned
from shardserve.layers.linear import ColumnParallelLinear, LinearBase, LinearMethod, RowParallelLinear, linear
from shardserve.utils import cdiv

FP8 = torch.float8_e4m3fn


def compact_scale_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales spread one row per output row [N, KB] -> (the distinct consecutive rows [R, KB],
    int32 [N]: each output row's index into them)."""
    changed = (rows[1:] != rows[:-1]).any(dim=1)   # a new scale row starts where a row's scales differ
    keep = torch.cat([changed.new_ones(1), changed])
    return rows[keep].contiguous(), (keep.cumsum(0) - 1).to(torch.int32)


class Fp8BlockLinearMethod(LinearMethod):
    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv") -> None:
        self.block_n, self.block_k = block
        self.scale_name = scale_name   # the checkpoint's name for the scales (compressed-tensors: weight_scale)

    def create_weights(self, layer: LinearBase) -> None:
        bn, bk = self.block_n, self.block_k
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1 and layer.input_size % bk:
            raise ValueError(f"tensor_parallel_size={layer.tp_size} gives each rank {layer.input_size} of a layer's "
                             f"{layer.input_size * layer.tp_size} inputs, not a multiple of the checkpoint's FP8 "
                             f"blocks of {bk}: the ranks would cut blocks in two; choose a size that keeps them whole")
        layer.register_weight(torch.empty(layer.output_size, layer.input_size, dtype=FP8))
        scales = layer.register_quant_param(self.scale_name,
                                            torch.ones(layer.output_size, cdiv(layer.input_size, bk),
                                                       dtype=torch.float32),
                                            output_dim=0, input_dim=1, full_precision=True)
        load_rows = scales.weight_loader
        cut_by_rows = isinstance(layer, ColumnParallelLinear)   # the loader slices a part / shard's rows itself

        def load_scales(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            rows = loaded.repeat_interleave(bn, 0)   # one scale row per weight row
            load_rows(param, rows if cut_by_rows else rows[:layer.output_size], shard_id)
        scales.weight_loader = load_scales

    def process_after_loading(self, layer: LinearBase) -> None:
        q, rows = layer.weight.data, getattr(layer, self.scale_name).data   # E4M3 [N, K], fp32 [N, ceil(K / BK)]
        delattr(layer, self.scale_name)
        scales, scale_row = compact_scale_rows(rows)
        if not (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (8, 9)):
            widened = reference.fp8_block_weight(q, scales, scale_row, self.block_k, layer.params_dtype)
            layer.weight = nn.Parameter(widened, requires_grad=False)
            return
        layer.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        layer.register_buffer("scale_row", scale_row)
        layer.register_buffer("weight_scale_grid", self._grid(q, rows))

    def _grid(self, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """The [N / 128, K / 128] scale grid cuBLAS's block-scaled matmul takes, where it runs the layer:
        128 x 128 blocks, every 128 rows one block row (no fused part or shard starting inside a
        block), K / 128 a multiple of 4."""
        (n, k), kb = q.shape, rows.shape[1]
        if (self.block_n, self.block_k) != (128, 128) or n % 128 or k % 128 or kb % 4:
            return None
        grid = rows[::128].contiguous()
        aligned = torch.equal(grid.repeat_interleave(128, 0), rows)
        return grid if aligned and triton_fp8_block.scaled_mm_works(q.device.index) else None

    def _dense(self, layer: LinearBase, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight in `dtype`, for cuBLAS."""
        args = (layer.weight, layer.weight_scale_inv, layer.scale_row, self.block_k)
        return triton_fp8_block.dequantize(*args, dtype) if tuned.ENABLED else reference.fp8_block_weight(*args, dtype)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.weight.dtype != FP8:
            return linear(x, layer.weight, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if tuned.ENABLED and x2.shape[0] > triton_fp8_block.MAX_ROWS and layer.weight_scale_grid is not None:
            out = triton_fp8_block.scaled_mm(x2, layer.weight, layer.weight_scale_grid, bias)   # prefill
        elif tuned.ENABLED and triton_fp8_block.handles(x2, layer.weight, self.block_k):
            out = triton_fp8_block.matmul(x2, layer.weight, layer.weight_scale_inv, layer.scale_row, self.block_k,
                                          bias)
        else:
            out = F.linear(x2, self._dense(layer, x.dtype), bias)
        return out.view(*shape[:-1], out.shape[-1])

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if (layer.weight.dtype != FP8 or x.dim() != 2 or not tuned.ENABLED
                or not triton_fp8_block.handles(x, layer.weight, self.block_k)):
            return None
        if x.shape[0] > triton_fp8_block.MAX_ROWS and layer.weight_scale_grid is not None:
            return None   # a prefill chunk: `apply`'s _scaled_mm, then SiLU-and-mul (2.5x faster at 128 rows)
        return triton_fp8_block.matmul(x, layer.weight, layer.weight_scale_inv, layer.scale_row, self.block_k,
                                       gated=True)

    def stack_linear(self, layer: LinearBase, gated: bool) -> StackLinear | None:
        """Widened on the CPU, the layer is a plain one to the one-call decoder stack."""
        if gated or layer.weight.dtype == FP8:
            return None
        return panels_linear(layer.weight, layer.output_size, layer.input_size, layer.bias)
