import faulthandler, sys, torch
faulthandler.enable()
sys.path.insert(0, ".")
from lmtier.codec import pca, rans
from lmtier.codec.pca import kernels, streams, codec
from tests.test_codec_pca_product import fitted, _kv
m = fitted("plain"); lv = m.levels["pca_high"]
kv = _kv(256, 0, 31, loud=(5, 77))
k = torch.from_numpy(lv.k).cuda(); thr = torch.from_numpy(lv.energy_threshold).cuda().double()
print("available", kernels.available(), flush=True)
sym, ex, es = kernels.encode(m, kv.cuda(), 0, k, thr); torch.cuda.synchronize(); print("kernels.encode ok", sym.shape, flush=True)
ref = codec.chunk_symbols(m, kv, 0, k.cpu(), thr.cpu())
print("sym same", torch.equal(sym.cpu(), ref[0]), torch.equal(ex.cpu(), ref[1]), torch.equal(es.cpu().long(), ref[2].long()), flush=True)
tables = torch.from_numpy(lv.tables).cuda()
n = m.vector_size
s0 = sym.reshape(2*m.rows, -1)
b = rans.encode([s0[0]], table_ids=0, tables=tables[:n], run_lens=256); print("rans.encode ok", b.nbytes, flush=True)
secs = streams.encode(s0, tables, 256); print("streams.encode ok", [len(x) for x in secs], flush=True)
import subprocess
code = """
import torch
from lmtier.codec import rans
s = torch.randint(0, 4, (4096,), dtype=torch.uint8, device='cuda')
out = torch.empty(20000, dtype=torch.uint8, device='cuda')
off = torch.empty(2, dtype=torch.int64, device='cuda'); st = torch.empty(1, dtype=torch.int32, device='cuda')
sc = torch.empty(rans.encode_scratch_bytes(1, 4096), dtype=torch.uint8, device='cuda')
try:
    rans.encode_into([s], rans.ADAPTIVE_TABLE, None, out=out[1:], offsets=off, status=st, scratch=sc)
    print('misaligned out: no error')
except Exception as e:
    print('misaligned out raised', type(e).__name__, e)
"""
r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".", env={**__import__("os").environ, "PYTHONPATH": "."})
print("subprocess rc", r.returncode, r.stdout[-500:], r.stderr[-800:])
