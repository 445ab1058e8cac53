"""Maintained tools, run from the repository root as `python -m tools.<name>`: the renderers (`make_*`: docs/*.md
and the README's rendered blocks from the committed docs/*.json records) and the checks kept beside the product
(gpu_check, gpu_recipe, fault_harness, wheel_smoke, kernel_asan, kernel_keep)."""
