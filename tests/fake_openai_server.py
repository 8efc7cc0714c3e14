"""A stand-in for vLLM's API server, for the tests of the execution seam (no vLLM needed).

Answers GET /health and GET /v1/models (the names after --served-model-name, as vLLM does), and starts
two "workers" in its process group that map a /dev/shm segment named like vLLM CPU's
(vllm_dist_<hex>-...) and, as vLLM's ZMQ does, bind a Unix socket in VLLM_RPC_BASE_PATH that they never
remove, so launch, tunnel, ownership check, liveness and teardown (processes by group and run token,
shared-memory files, the socket folder) are exercised for real.

python tests/fake_openai_server.py --served-model-name m alias --host 127.0.0.1 --port 8000
"""
import argparse
import json
import subprocess
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORKER = """
import mmap, os, socket, sys, time, uuid
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
if os.environ.get("VLLM_RPC_BASE_PATH"):
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4())))
time.sleep(100000)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--served-model-name", nargs="+", default=["m"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    ident = f"vllm_dist_{uuid.uuid4().hex[:16]}"
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, f"/dev/shm/{ident}-test-{i}"]) for i in range(2)]
    names = args.served_model_name

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *a):
            sys.stderr.write("fake-server: " + (fmt % a) + "\n")

        def do_GET(self):
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                body = json.dumps({"data": [{"id": n} for n in names]}).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake server on {args.host}:{args.port}, workers {[w.pid for w in workers]}, shm {ident}", flush=True)
    try:
        server.serve_forever()
    finally:
        for w in workers:
            w.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
