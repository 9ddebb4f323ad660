"""``lmtier bench ttft``: time to first token, recomputing the prefill vs loading its KV from a tier
through lmtier's own load path.

Model: a Llama-3.1-8B-shaped ``transformers`` ``LlamaForCausalLM`` with random weights (bf16, SDPA;
compute cost is what matters; :data:`lmtier.bench.presets.PRESETS`; SmolLM2-135M-shaped on the CPU),
``--model PATH`` for a real local model, ``--preset tiny`` for CPU smoke runs. A random model's KV is
flatter than a trained one's; ``--kv-spectrum trained`` reshapes its ``k_proj`` / ``v_proj`` so the KV's
spectrum decays as SmolLM2-135M's (:func:`.model.shape_kv_spectrum`), which matters to the PCA levels.
Per context length ``N`` (median of ``--iters`` after ``--warmup`` runs):

* ``recompute`` — prefill of ``N + 1`` tokens until the logits of the last position exist.
* every cached path — the prefix's KV (``N`` tokens, built once by a prefill) sits in a tier as
  canonical chunks of ``--chunk-tokens`` (the last one zero-padded; chunk keys by
  :func:`lmtier.keys.chunk_keys`, stored through ``TierManager.store``). TTFT = the tier's load into
  the model's **paged KV cache** (vLLM's layout, ``--block-size``-token blocks; :mod:`.pipeline`) +
  a lean forward of the last token over strided views of that cache (:mod:`.model`; our own loop
  over ``model.model.layers``, no ``generate``/cache machinery), overlapped layer by layer on CUDA.
  Every load is the vLLM connector's data path: a
  :class:`lmtier.integration.vllm.worker.ConnectorWorker` ``load_layerwise`` of one ``LoadOp``
  naming the request's blocks (CUDA: one ``CudaTransferEngine.load_layerwise``), layer ``l``'s
  attention preceded by the worker's ``wait_layer(l)``, ``finish_layerwise`` after the forward. On
  CUDA the lean forward runs as CUDA graphs (``--graphs auto``, one per decoder layer + embedding +
  head, captured per N over static buffers; eager fallback with a printed reason). ``load_ms`` (the
  worker's synchronous ``load`` alone), ``fwd_ms`` (forward alone, KV resident), ``fwd_eager_ms``
  and ``cpu_eager_ms`` (eager forward) are reported too, plus (``--compare-layouts``) the eager forward
  over contiguous ``[1, H, N, D]`` K/V and the transpose that would produce them.
* ``cpu`` — the CPU pool (``local_cpu``): chunks copied from the pool's pinned slots.
* ``disk`` — the disk tier (``local_disk``, O_DIRECT, checksummed records) in ``--disk-dir``; the
  page cache is dropped once per N when permitted (before every load without O_DIRECT). Chunks are
  read by ``TierManager.fetch_lower_many`` on the worker's ``--inflight`` I/O threads into its reused,
  page-aligned staging buffers (the lower tiers' managers have no CPU pool: nothing is promoted).
* ``disk+codec`` (level ``default``) and ``disk+<level>`` (``--codec-levels``, default
  ``default,lossless``) — the disk tier wrapped in :class:`lmtier.tiers.codec.CodecTier` (quantize +
  rANS records, encoded once when stored, untimed); ``CodecTier.get_into`` decodes on the GPU into
  the worker's device staging, scattered device -> paged blocks (``--codec-decode device``, the
  worker's default for codec tiers on CUDA) or on the host (``host``: the worker's host path).
  ``*_ratio`` = KV bytes / record bytes; ``*_mem_ms`` = the same decode with the records in a CPU
  pool (no reads). Lossy levels' tables: ``--codec-tables`` (:mod:`.tables`);
  their KV is checked bit for bit against the reference decoder
  (:func:`lmtier.codec.quant.dequantize`), their logits are reported, not judged.
* ``disk+pca_default`` / ``disk+pca_high`` (``--codec-levels pca_default,...``; experimental,
  docs/codec.md "PCA levels") — the disk tier at a PCA level, built from the configuration a user
  writes (``local_disk_serde: cachegen``, ``codec_level``, ``codec_pca_model``):
  :class:`lmtier.tiers.codec_pca.PCACodecTier`, each chunk encoded (untimed) at its position
  ``c * --chunk-tokens``. The model file: ``--codec-pca-model FILE``, else fitted by the bench,
  untimed, on the prefill KV of other random token ids than the measured prompt's
  (:mod:`.pca_model`: ``--codec-pca-fit-tokens``, default 16 x N, the calibrate command's default
  layer group, the model's rotary frequencies, no metric; the stored chunks are unseen by the fit,
  as a user's are by their calibration); the output and the JSON (``codec_pca_model``) say which. A
  file the product refuses (not a PCA model, another ``(L, H, D)``, the level missing) skips the tier
  with the product's reason printed. The
  KV is checked bit for bit against :func:`lmtier.codec.pca.decode` of the record
  :func:`lmtier.codec.pca.encode` makes of the chunk (the stored bytes: the encode is deterministic).
* ``mooncake`` / ``mooncake+codec`` — the Mooncake Store tier (``remote_url: mooncakestore://``)
  through the same path, against a private ``mooncake_master`` and one store server on loopback
  (skipped when the client is not installed: ``scripts/setup_mooncake.sh``).
* ``redis`` / ``redis+codec`` — the Redis tier (``remote_url``) through the same path: against
  ``--redis-url`` (or ``$LMTIER_REDIS_URL``), else a private ``redis-server`` on loopback when one is
  found (``$LMTIER_REDIS_SERVER`` or PATH); skipped with a line otherwise.
* ``redis+pca_default``, ``mooncake+pca_default`` (and ``pca_high``) — the remote tiers at the PCA
  levels of ``--codec-levels`` (``remote_serde: cachegen``, the same model file as the disk tier's).

Every tier is a :class:`lmtier.manager.TierManager` built by ``TierManager.from_config`` from the
configuration keys a user writes (:func:`.pipeline.build_manager`).

Ceilings measured in the same run (:mod:`.ceilings`): pinned H2D bandwidth (contiguous copy) -> the
CPU tier's physical limit ``N x bytes/token / BW``; ``dd`` O_DIRECT and ``--inflight`` parallel
O_DIRECT reads of the disk directory -> the disk tiers' limits; raw-socket ``GETRANGE`` reads of one
chunk-sized value, ``--inflight`` at once -> the Redis tiers' limits. Correctness: every cached
path's next-token logits are compared with the recompute logits (max abs diff <= RTOL x max|logit|
and cosine >= MIN_COS; the paged cache is NaN-filled first so a path that skips a byte cannot pass),
and the loaded prefix KV must equal the prefill's bit for bit (the hard guard; a lossy codec level's:
the reference decoder's); a control (chunk 0's
KV loaded where chunk 1 belongs: a wrong-index load) shows how far a wrong path lands.
"""

from __future__ import annotations

import argparse
import os

from lmtier.bench.args import bounded_int, int_list, name_list, output_file
from lmtier.bench.common import write_json
from lmtier.bench.presets import PRESETS
from lmtier.bench.ttft.report import MIN_COS, RTOL, TIERS, break_even, compare, plot, report
from lmtier.bench.ttft.tables import CALIB_SEED
from lmtier.config_schema import CODEC_LEVELS, PCA_CODEC_LEVELS
from lmtier.integration.vllm.fetch import DEFAULT_FETCH_BATCH

__all__ = ["main", "parser", "RTOL", "MIN_COS", "TIERS", "CALIB_SEED", "compare", "break_even", "DEFAULT_LENGTHS"]

DEFAULT_LENGTHS = "1024,2048,4096,7500,16384,32768"
DEFAULT_PRESET = {"cuda": "llama-3.1-8b", "cpu": "smollm2-135m"}
"""``--model-preset`` by device when not given (a random 8B model in bf16 is 16 GB of CPU memory)."""


def parser() -> argparse.ArgumentParser:
    """The ``lmtier bench ttft`` argument parser."""
    llama = sorted(k for k, v in PRESETS.items() if v.llama is not None)
    p = argparse.ArgumentParser(
        prog="lmtier bench ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument(
        "--preset",
        "--model-preset",
        dest="preset",
        type=str.lower,
        default=None,
        help=f"random-weight model shape (ignored with --model): {', '.join(llama)} (default: "
        f"{DEFAULT_PRESET['cuda']} on CUDA, {DEFAULT_PRESET['cpu']} on the CPU); "
        "llama-3.1-70b-tp8 = one TP rank's shard (no all-reduce); the MLA preset of the other "
        "subcommands has no transformers shape here (use --model)",
    )
    p.add_argument("--model", default=None, help="path of a local transformers model (Llama-like)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--kv-spectrum",
        choices=["model", "trained"],
        default="model",
        help="random-weight models: 'trained' reshapes each layer's k_proj / v_proj so the KV's "
        "eigen-spectrum decays as a trained model's (measured on SmolLM2-135M: "
        "lmtier.bench.ttft.model.TRAINED_KV_ALPHA); 'model' (default): the weights as built",
    )
    p.add_argument(
        "--lengths", type=int_list(min_value=1), default=DEFAULT_LENGTHS, help="comma-separated context lengths N"
    )
    p.add_argument("--iters", type=bounded_int(min_value=1), default=5)
    p.add_argument("--warmup", type=bounded_int(min_value=0), default=2)
    p.add_argument("--chunk-tokens", type=bounded_int(min_value=1), default=256)
    p.add_argument(
        "--block-size",
        type=bounded_int(min_value=1),
        default=None,
        help="tokens per block of the paged KV cache (default: gcd(chunk tokens, 16))",
    )
    p.add_argument(
        "--layers-per-wait",
        type=bounded_int(min_value=1),
        default=None,
        help="layers per event of the layer-by-layer copy (CUDA; default max(1, layers // 8), the "
        "connector worker's default)",
    )
    p.add_argument(
        "--compare-layouts",
        action="store_true",
        help="also time the forward over contiguous [1,H,N,D] K/V and the transpose to it",
    )
    p.add_argument("--disk-dir", default=None, help="directory on the disk to test (default: a temp dir on disk)")
    p.add_argument("--disk-threads", type=bounded_int(min_value=1), default=4, help="disk_io_threads of the disk tiers")
    p.add_argument(
        "--dd-bytes", type=bounded_int(min_value=1), default=1 << 30, help="bytes dd writes/reads for the disk ceiling"
    )
    p.add_argument("--keep-disk", action="store_true")
    p.add_argument("--no-disk", action="store_true")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake Store tiers")
    p.add_argument(
        "--remote-seal",
        choices=["none", "mac", "encrypt"],
        default="none",
        help="seal the Redis and Mooncake tiers' records (remote_auth_key with a random key; encrypt: also "
        "remote_encrypt); default: %(default)s",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis server (default: $LMTIER_REDIS_URL, else start a private redis-server "
        "on loopback when one is found: $LMTIER_REDIS_SERVER, PATH)",
    )
    p.add_argument(
        "--ring",
        type=bounded_int(min_value=2),
        default=3,
        help="ignored (kept for old command lines): the connector worker's CudaTransferEngines use their "
        "default ring of 3 staging slots",
    )
    p.add_argument(
        "--inflight",
        type=bounded_int(min_value=1),
        default=4,
        help="chunk reads in flight (I/O threads calling TierManager.fetch_lower_many)",
    )
    p.add_argument(
        "--fetch-batch",
        type=bounded_int(min_value=1),
        default=DEFAULT_FETCH_BATCH,
        help="chunks one I/O task fetches together from a P2P or remote tier that batches gets; the "
        "connector worker's fetch_batch (default: %(default)s, its default)",
    )
    p.add_argument(
        "--pca-python-decode",
        action="store_true",
        help="decode the PCA levels' records on CUDA with the kernels queued one by one from Python, "
        "not one native call each (lmtier.codec.pca.native_decode.enable(False))",
    )
    p.add_argument(
        "--graphs",
        choices=["auto", "off", "nocapture"],
        default="auto",
        help="lean forward as CUDA graphs (auto: on CUDA, eager fallback if capture fails); off: eager; "
        "nocapture: the graph code path run eagerly (tests)",
    )
    p.add_argument(
        "--codec-levels",
        type=name_list(CODEC_LEVELS + PCA_CODEC_LEVELS, allow_empty=True),
        default="default,lossless",
        help="codec levels for the disk+<level> tiers (comma-separated; '' to skip); 'default' and the "
        "PCA levels (pca_high, pca_default) also for the Redis / Mooncake tiers",
    )
    p.add_argument(
        "--codec-pca-model",
        default=None,
        metavar="FILE",
        help="codec_pca_model of the PCA levels (a file of python -m lmtier.codec.pca); default: fitted by "
        "the bench, untimed, on the KV of other random token ids (lmtier.bench.ttft.pca_model)",
    )
    p.add_argument(
        "--codec-pca-fit-tokens",
        type=bounded_int(min_value=1),
        default=None,
        metavar="N",
        help="tokens of other random token ids the bench fits its PCA model file on (no --codec-pca-model); "
        "default: 16 per value of a vector, N = G*H*D (lmtier.bench.ttft.pca_model.FIT_TOKENS_PER_VALUE)",
    )
    p.add_argument(
        "--codec-decode",
        choices=["device", "host"],
        default="device",
        help="CUDA: the connector worker's decode_on for the codec tiers: GPU decode into device "
        "staging (device, the worker's default) or CPU decode into host staging, then the host -> "
        "cache copy (host)",
    )
    p.add_argument(
        "--codec-tables",
        default="calibrate",
        help="rANS tables of the lossy codec tiers: 'calibrate' (static tables calibrated, untimed, on "
        "the KV of other random token ids of the same model, once per level), a PATH (.npz of "
        "lmtier.codec.calibrate.save: loaded; levels it lacks are calibrated and written into "
        "it), 'shipped' (the product's default: local_disk_serde/remote_serde cachegen through "
        "the config) or 'none' (per-stream tables in every record)",
    )
    p.add_argument(
        "--codec-calib-tokens",
        type=bounded_int(min_value=1),
        default=4096,
        help="tokens of calibration input for --codec-tables calibrate / PATH",
    )
    p.add_argument("--threads", type=bounded_int(min_value=1), default=2, help="torch CPU threads (CPU runs)")
    p.add_argument("--json", type=output_file, default=None)
    p.add_argument("--plot", type=output_file, default=None, help="PNG path for TTFT vs N per tier")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> int:
    """``lmtier bench ttft [options]``; returns 0 when every check passed, else 1."""
    from lmtier.bench.ttft.run import run

    p = parser()
    args = p.parse_args(argv)
    if (
        not args.model
        and args.preset is not None
        and (args.preset not in PRESETS or PRESETS[args.preset].llama is None)
    ):
        llama = sorted(k for k, v in PRESETS.items() if v.llama is not None)
        p.error(
            f"--model-preset {args.preset!r}: the ttft bench builds a Llama-shaped transformers model; "
            f"choose from {', '.join(llama)} or pass --model PATH"
        )
    if args.model and args.kv_spectrum != "model":
        p.error("--kv-spectrum trained reshapes a random-weight model; a --model keeps its own weights")
    if args.codec_pca_model is not None:
        if not any(lv in PCA_CODEC_LEVELS for lv in args.codec_levels):
            p.error(f"--codec-pca-model: no PCA level ({', '.join(PCA_CODEC_LEVELS)}) in --codec-levels")
        if not os.path.isfile(args.codec_pca_model) or not os.access(args.codec_pca_model, os.R_OK):
            p.error(f"--codec-pca-model {args.codec_pca_model}: not a readable file")
    if args.codec_pca_fit_tokens is not None and args.codec_pca_model is not None:
        p.error("--codec-pca-fit-tokens: the bench fits no PCA model file when --codec-pca-model names one")
    if args.pca_python_decode:
        from lmtier.codec.pca import native_decode

        native_decode.enable(False)
    res = run(args)
    report(res)
    write_json(args.json, res)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        why = plot(
            res["rows"], args.plot, f"TTFT vs context: {res['model']} on {res['system'].get('gpu', res['device'])}"
        )
        print(f"plot: skipped — {why}" if why else f"wrote {args.plot}")
    return 0 if res["checks_ok"] else 1
