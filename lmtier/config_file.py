"""Reading lmtier's YAML configuration file strictly: one mapping, UTF-8, every key once.

Used by :func:`lmtier.config.load_config`. ``yaml.safe_load`` alone lets the last of two equal
keys win without a word (``chunk_size: 256`` then ``chunk_size: 16`` is 16) and raises
``UnicodeDecodeError`` on a file that is not UTF-8; here both are a :class:`ConfigError` naming
the file (and the key). Imports PyYAML lazily; no torch.
"""

from __future__ import annotations

import os
from typing import Any

from lmtier.config_schema import ConfigError

__all__ = ["read_config_file"]


def _strict_loader() -> type:
    """A ``yaml.SafeLoader`` subclass whose mappings refuse a key given twice."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # noqa: ANN001 - PyYAML's signature
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    dup = False
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"key {key!r} is given twice",
                        key_node.start_mark,
                    )
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (an empty file: ``{}``).

    Raises:
        ConfigError: the file cannot be read or is not UTF-8, malformed YAML, a key given twice in
            one mapping, or a top level that is not a mapping (the message names the file).
    """
    import yaml

    where = repr(os.fspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            loader = _strict_loader()(f)  # a SafeLoader subclass: what yaml.safe_load runs, stricter
            try:
                loaded = loader.get_single_data()
            finally:
                loader.dispose()
    except OSError as e:
        raise ConfigError(f"lmtier config: cannot read config file {where}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"lmtier config: config file {where} is not UTF-8 text: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"lmtier config: malformed YAML in {where}: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"lmtier config: {where} must hold a mapping, got {type(loaded).__name__}")
    return loaded
