"""Peak resident memory of a server answering GET /export of 512-token MiniLM texts (30 MB files):
one, another, then four at once from four clients, each against the server's resident memory just
before. `python bench/export_peak.py [CHECKOUT] [PORT]`: a server of that checkout's code
(PYTHONPATH), so that two checkouts run side by side.

A run of several samples is noisy on a shared machine: compare checkouts in one sitting."""
import asyncio, os, subprocess, sys, time, threading, httpx
src = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()
port = int(sys.argv[2]) if len(sys.argv) > 2 else 9181
env = {**os.environ, "PYTHONPATH": src, "MANYEYES_MODELS": '{"minilm":"minilm"}', "MANYEYES_WARMUP": "false"}
proc = subprocess.Popen([sys.executable, "-m", "manyeyes.app.cli", "serve", "--port", str(port)], env=env, cwd=src,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
B = f"http://127.0.0.1:{port}"
while True:
    try:
        if httpx.get(B + "/readyz").status_code == 200: break
    except httpx.TransportError: pass
    time.sleep(0.3)
def rss(): return int(open(f"/proc/{proc.pid}/status").read().split("VmRSS:")[1].split()[0]) // 1024
def measure(n, seed):
    peak, stop = [0], [False]
    def poll():
        while not stop[0]: peak[0] = max(peak[0], rss()); time.sleep(0.01)
    rest = rss(); t = threading.Thread(target=poll); t.start()
    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            async def one(i):
                text = " ".join(f"t{seed}x{i}y{j}" for j in range(2000))
                r = await c.get(B + "/export", params={"text": text, "model": "minilm", "truncate": "true"}, headers={"X-Forwarded-For": f"10.1.0.{i}"})
                return r.status_code, len(r.content)
            return await asyncio.gather(*(one(i) for i in range(n)))
    got = asyncio.run(main()); stop[0] = True; t.join()
    print(f"{src}: {n} export(s) {got[0]}: rest {rest} MiB, peak {peak[0]} MiB, +{peak[0]-rest} MiB", flush=True)
try:
    measure(1, 0); measure(1, 1); measure(4, 2)
finally:
    proc.terminate(); proc.wait()
