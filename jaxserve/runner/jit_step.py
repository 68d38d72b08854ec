"""A step function jitted once per set of XLA compiler options.

    @step(static_argnames=..., donate_argnames=...)   in place of functools.partial(jax.jit, ...)
    def generate(params, cache, state, ...): ...

    generate(...)                       jax.jit with XLA's default options (tests, the CPU)
    generate.jit(options)(...)          jax.jit with `options` ((name, value) pairs): what the
                                        runner calls with its `Resolved.compiler_options`
    generate.lower(...) / .trace(...)   the default one's
    generate._cache_size()              programs compiled, every option set together

Why per call site and not per process: XLA reads XLA_FLAGS once, when its backend starts (before a
notebook builds its first engine), and the options are a choice of the engine's backend and
weights (`gpu_choices.gpu_compiler_options`), so each engine compiles its programs with its own. The
options are part of the persistent compilation cache's key like any compile option.
"""

from __future__ import annotations

import functools

import jax


class Step:
    def __init__(self, fn, **jit_kwargs):
        functools.update_wrapper(self, fn)
        self._fn, self._jit_kwargs, self._jits = fn, jit_kwargs, {}

    def jit(self, options: tuple[tuple[str, str], ...] = ()):
        """The jax.jit function compiled with XLA `options` (one per distinct set)."""
        fn = self._jits.get(options)
        if fn is None:
            fn = self._jits[options] = jax.jit(
                self._fn, compiler_options=dict(options) or None, **self._jit_kwargs
            )
        return fn

    def __call__(self, *args, **kwargs):
        return self.jit()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jit().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jit().trace(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled so far, over every set of options (what tests count)."""
        return sum(fn._cache_size() for fn in self._jits.values())


def step(**jit_kwargs):
    """The decorator: `jax.jit`'s keywords (static_argnames, donate_argnames, ...)."""
    return lambda fn: Step(fn, **jit_kwargs)
