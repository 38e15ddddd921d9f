"""Triton's CPU interpreter, made cheaper for the tests that run the CUDA backend's kernels on CPU.

Each launch (`kernel[grid](...)`) patches triton.language's builtins into their interpreted
forms, runs every program, and restores them. A call from a kernel to another @triton.jit
function (the attention kernels' shared tile steps, the 4-bit tile loader, triton.language's own
`zeros`) patches the language modules its globals name again, every time: an
`inspect.getmembers` walk of triton.language, its tensor and math, about 1.7 ms a call, under
which a decode kernel's per-tile helper calls had spent a third of the interpreter's time.
`patch_once_a_launch` keeps, for the launch under way, which language modules are patched, and
lets a nested call patch only a module not yet patched (once); the launch's end forgets them.
Were a nested call to need patching that was skipped, it would fail loudly (an unpatched
builtin asks for a compiler's builder), not compute something else.
"""

from __future__ import annotations

import inspect


def patch_once_a_launch() -> bool:
    """Install it; False (and nothing changed) where this Triton's interpreter is not laid out
    as expected."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "once_a_launch", False):
        return patch is not None
    langs_of: dict[int, frozenset[int]] = {}
    launch: dict = {"scope": None, "patched": set()}

    def _patch_lang(fn):
        langs = langs_of.get(id(fn))
        if langs is None:
            values = fn.__globals__.values()
            langs = frozenset(id(v) for v in values if inspect.ismodule(v) and v in (tl, tl.core))
            langs_of[id(fn)] = langs
        if launch["scope"] is None:  # a launch: patched now, restored when its programs end
            scope = patch(fn)
            restore = scope.restore

            def restore_and_forget() -> None:
                launch["scope"] = None
                launch["patched"].clear()
                restore()

            scope.restore = restore_and_forget
            launch["scope"] = scope
            launch["patched"] = set(langs)
            return scope
        if not langs <= launch["patched"]:  # a nested call naming a module not yet patched
            patch(fn)
            launch["patched"] |= langs
        return launch["scope"]

    _patch_lang.once_a_launch = True
    interpreter._patch_lang = _patch_lang
    return True
