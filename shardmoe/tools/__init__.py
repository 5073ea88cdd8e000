"""The measurement tools, apart from the library a user imports (docs/architecture.md, "Layers of the
package"): nothing below this layer imports it.

  bench      `shardmoe bench`: the MoE layer against its anchors, one transformers family's block
             or whole model (--hf), the expert-parallel layer on a mesh under torchrun (--mesh)
  gpu_check  `python -m shardmoe.tools.gpu_check --out DIR`: what a GPU lease measures (docs/gpu.md)
"""
