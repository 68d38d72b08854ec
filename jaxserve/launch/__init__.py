"""absl entry points (`python -m jaxserve.launch.<name>`): generate, merge, bench, convert.

The engine flags they share are defined once, in `jaxserve.launch.flags`.
"""
