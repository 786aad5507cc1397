"""Small helpers shared by the HTTP tests (stdlib only): raw HTTP/1.1 over sockets, SSE parsing.

Raw sockets rather than http.client where the test needs to see exactly what the server sends
(pipelining, connection close, chunked framing)."""
import json
import socket
import time


class Resp:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return "Resp(%d, %r)" % (self.status, self.body[:200])


def connect(port, timeout=30):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class Reader:
    """Reads HTTP responses from a socket, one after another (keep-alive, pipelining)."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = b""

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("connection closed by the server")
        self.buf += data

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def head(self):
        status_line = self._line().decode()
        parts = status_line.split(" ", 2)
        status = int(parts[1])
        headers = {}
        while True:
            line = self._line()
            if not line:
                break
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        return status, headers

    def chunks(self):
        """Yields the chunks of a chunked body as they arrive."""
        while True:
            size = int(self._line().split(b";")[0], 16)
            if size == 0:
                self._line()
                return
            data = self._exact(size)
            self._exact(2)
            yield data

    def response(self):
        status, headers = self.head()
        if status == 100:
            status, headers = self.head()
        if headers.get("transfer-encoding") == "chunked":
            body = b"".join(self.chunks())
        elif "content-length" in headers:
            body = self._exact(int(headers["content-length"]))
        else:
            while True:
                try:
                    self._fill()
                except EOFError:
                    break
            body, self.buf = self.buf, b""
        return Resp(status, headers, body.decode("utf-8", "replace"))

    def closed(self, timeout=5):
        """True if the server closes the connection (EOF) within timeout."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True


def request_bytes(method, path, body=None, headers=None, version="1.1"):
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    h = {"Host": "127.0.0.1"}
    if body is not None:
        h["Content-Type"] = "application/json"
        h["Content-Length"] = str(len(body))
    h.update(headers or {})
    head = "%s %s HTTP/%s\r\n" % (method, path, version)
    head += "".join("%s: %s\r\n" % kv for kv in h.items()) + "\r\n"
    return head.encode() + (body or b"")


def call(port, method, path, body=None, headers=None, timeout=60):
    s = connect(port, timeout)
    try:
        s.sendall(request_bytes(method, path, body, headers))
        return Reader(s).response()
    finally:
        s.close()


def sse_events(body):
    """The data payloads of an SSE body, in order."""
    out = []
    for block in body.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def wait_for(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)
