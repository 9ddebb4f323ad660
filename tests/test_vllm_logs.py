"""lmtier's loggers routed into vLLM's logging, and the connector's startup line
(:mod:`lmtier.integration.vllm.logs`). No engine: the functions are called directly."""

from __future__ import annotations

import contextlib
import logging

import pytest

pytest.importorskip("vllm")

from lmtier.config import LMTierConfig  # noqa: E402
from lmtier.integration.vllm.logs import route_lmtier_logging, startup_line  # noqa: E402
from lmtier.integration.vllm.options import ConnectorOptions  # noqa: E402


class _Collect(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _bare_root():
    """The root logger without handlers and the ``vllm`` logger with only the test's, as in a vLLM
    process. pytest attaches its capture handlers to both (root and every non-propagating logger)
    for the test's call phase and removes them afterwards: they are put back before that."""
    root, vl = logging.getLogger(), logging.getLogger("vllm")
    saved = [(lg, lg.handlers[:]) for lg in (root, vl)]
    root.handlers.clear()
    vl.handlers[:] = [h for h in vl.handlers if isinstance(h, _Collect)]
    try:
        yield root
    finally:
        for lg, handlers in saved:
            lg.handlers[:] = handlers


@pytest.fixture
def loggers():
    """The ``lmtier`` and ``vllm`` loggers as vLLM leaves them (one handler on ``vllm`` at INFO,
    ``propagate=False``; nothing on ``lmtier``), restored afterwards."""
    lm, vl = logging.getLogger("lmtier"), logging.getLogger("vllm")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (lm, vl)]
    for lg in (lm, vl):
        lg.handlers.clear()
    lm.setLevel(logging.NOTSET)
    lm.propagate = True
    vllm_handler = _Collect()
    vl.addHandler(vllm_handler)
    vl.setLevel(logging.INFO)
    vl.propagate = False
    try:
        yield lm, vl, vllm_handler
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)  # also clears the children's cached levels
            lg.propagate = propagate


def _messages(h: _Collect) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in h.records]


def test_lmtier_records_reach_vllms_handler_once(loggers):
    lm, _, vllm_handler = loggers
    on_root = _Collect()
    with _bare_root() as root:
        assert route_lmtier_logging() is True
        assert lm.handlers == [vllm_handler] and lm.level == logging.INFO and lm.propagate is False
        root.addHandler(on_root)  # a root handler added later must not see the record a second time
        logging.getLogger("lmtier.tiers.disk").warning("disk record %s is corrupt; deleting it", "ab12")
        logging.getLogger("lmtier.config").info("lmtier effective config: chunk_size=%d", 256)
        logging.getLogger("lmtier.config").debug("not at INFO")
    assert _messages(vllm_handler) == [
        ("lmtier.tiers.disk", "WARNING", "disk record ab12 is corrupt; deleting it"),
        ("lmtier.config", "INFO", "lmtier effective config: chunk_size=256"),
    ]
    assert on_root.records == []
    assert route_lmtier_logging() is False  # the other role in the same process: nothing added twice
    assert lm.handlers == [vllm_handler]


def test_vllm_logging_level_is_followed(loggers):
    lm, vl, vllm_handler = loggers
    vl.setLevel(logging.WARNING)  # what VLLM_LOGGING_LEVEL=WARNING makes of vLLM's logger
    with _bare_root():
        assert route_lmtier_logging() is True
    assert lm.level == logging.WARNING
    logging.getLogger("lmtier.config").info("dropped")
    logging.getLogger("lmtier.config").warning("kept")
    assert _messages(vllm_handler) == [("lmtier.config", "WARNING", "kept")]


def test_a_users_handler_on_lmtier_is_left_alone(loggers):
    lm, _, vllm_handler = loggers
    mine = _Collect()
    lm.addHandler(mine)
    lm.setLevel(logging.DEBUG)
    with _bare_root():
        assert route_lmtier_logging() is False
    assert lm.handlers == [mine] and lm.level == logging.DEBUG and lm.propagate is True
    logging.getLogger("lmtier.tiers.disk").warning("w")
    assert _messages(mine) == [("lmtier.tiers.disk", "WARNING", "w")] and vllm_handler.records == []


def test_a_users_root_handler_is_left_alone(loggers):
    lm, _, vllm_handler = loggers
    mine = _Collect()
    with _bare_root() as root:
        root.addHandler(mine)  # logging.basicConfig(...)
        assert route_lmtier_logging() is False
        assert lm.handlers == [] and lm.propagate is True
        logging.getLogger("lmtier.tiers.disk").warning("w")
    assert _messages(mine) == [("lmtier.tiers.disk", "WARNING", "w")] and vllm_handler.records == []


def test_no_vllm_handler_nothing_to_share(loggers):
    lm, vl, _ = loggers
    vl.handlers.clear()  # VLLM_CONFIGURE_LOGGING=0
    with _bare_root():
        assert route_lmtier_logging() is False
    assert lm.handlers == [] and lm.propagate is True


def test_startup_line_names_serdes_codec_level_and_pca_model(tmp_path):
    model = tmp_path / "m.lmtpca"
    model.write_bytes(b"x")  # the config checks only that the file is readable
    config = LMTierConfig.from_dict(
        {
            "chunk_size": 256,
            "local_disk": f"file://{tmp_path}/disk",
            "max_local_disk_size": 1,
            "local_disk_serde": "cachegen",
            "codec_level": "pca_default",
            "codec_pca_model": str(model),
            "remote_url": "redis://localhost:6379/0",
            "remote_serde": "naive",
        }
    )
    options = ConnectorOptions()
    tiers = {"cpu": True, "disk": True, "remote": True}
    head = (
        "lmtier connector (WORKER) namespace 0123456789abcdef, chunk 256 tokens, tiers: cpu=True disk=True remote=True"
    )
    line = startup_line("WORKER", "0123456789abcdef", config, tiers=tiers, options=options, pca_model_id=0x1A2B3C4D)
    assert line == (
        f"{head}, serde: disk=cachegen(pca_default) remote=naive, codec_pca_model '{model}' (id 0x1a2b3c4d), "
        f"{options!r}"
    )
    assert "\n" not in line
    line = startup_line(
        "WORKER",
        "0123456789abcdef",
        config,
        tiers=tiers,
        options=options,
        pca_model_id=0x1A2B3C4D,
        tp_rank=1,
        tp_size=2,
    )
    assert f"codec_pca_model '{model}' (rank 1 of 2: id 0x1a2b3c4d), " in line  # a tensor-parallel file's rank model
    # the scheduler in another process has no model id to show; a role without the disk tier lists no disk serde
    line = startup_line("SCHEDULER", "0123456789abcdef", config, tiers=tiers | {"disk": False}, options=options)
    assert line == (
        "lmtier connector (SCHEDULER) namespace 0123456789abcdef, chunk 256 tokens, tiers: cpu=True disk=False "
        f"remote=True, serde: remote=naive, {options!r}"
    )


def test_startup_line_cachegen_level_and_no_lower_tier():
    config = LMTierConfig.from_dict({"remote_url": "redis://localhost:6379/0", "remote_serde": "cachegen"})
    tiers = {"cpu": True, "disk": False, "remote": True}
    line = startup_line("WORKER", "ff" * 8, config, tiers=tiers, options=ConnectorOptions())
    assert ", serde: remote=cachegen(default), ConnectorOptions(" in line
    line = startup_line("WORKER", "ff" * 8, LMTierConfig(), tiers=tiers | {"remote": False}, options=ConnectorOptions())
    assert "remote=False, ConnectorOptions(" in line and "serde" not in line
