"""Fused kernels, importable as `dflash_ray.kernels` (never as a top-level `kernels`: a PyPI
package of that name exists and transformers probes for it)."""
