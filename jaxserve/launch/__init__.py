"""absl entry points (`python -m jaxserve.launch.<name>`): generate, merge, bench, convert.

The engine flags they share are generated in `jaxserve.launch.flags`, one per `EngineConfig` field.
"""
