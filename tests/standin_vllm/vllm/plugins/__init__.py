"""vLLM's plugin loader, as 0.33.0 behaves: entry points of ``vllm.general_plugins``, filtered by
``VLLM_PLUGINS`` (comma-separated names; unset: all), each called with no arguments, once per
process."""

import importlib.metadata
import os

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"
plugins_loaded = False


def load_general_plugins() -> None:
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    allowed = os.environ.get("VLLM_PLUGINS")
    names = None if allowed is None else allowed.split(",")
    for ep in importlib.metadata.entry_points(group=DEFAULT_PLUGINS_GROUP):
        if names is None or ep.name in names:
            ep.load()()
