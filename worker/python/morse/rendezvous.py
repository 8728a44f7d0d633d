"""morse-run's rendezvous across nodes: how M invocations of the same
command, one per node, become one job.

Node 0 listens on --rdzv HOST:PORT (the Store). Every other node connects
(join), says who it is and what it was asked to run, and waits; once all
M - 1 have joined and agree with node 0 on the topology, node 0 starts the
shards and sends each node the job (shard addresses, the base config, the
world size). While the ranks run, each node reports how its ranks ended,
and node 0 tells the others to stop when any node fails or drops out.

The wire is one JSON object per line over TCP, plaintext: the rendezvous
carries no secrets (credentials are files on each node), but it is meant
for the job's private network, as torchrun's store is.

  node i -> node 0   {"version": 1, "join": i, "nnodes": M, "nproc_per_node": L,
                      "host": name, "config": text, "servers": spec,
                      "aggregation": false | "leader" | "sharded"}
  node 0 -> node i   {"job": {"servers": [...], "config": text, "world_size": M * L,
                              "master_port": port}}
                     or {"error": why} (and the connection closes)
  node i -> node 0   {"exit": code, "why": line}      when its ranks have ended
  node 0 -> node i   {"stop": why, "code": code}      when the job ends elsewhere
"""
import json
import queue
import socket
import threading
import time

VERSION = 1


class RendezvousError(Exception):
    """The job cannot start or go on: the message says why and what to do."""


def split_address(text):
    """HOST:PORT (or [v6]:PORT) -> (host, port), with a clear error."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"--rdzv {text!r}: give HOST:PORT, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def loopback(host):
    """Whether `host` is spelled as loopback: 127.x.x.x, localhost or ::1."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def loopback_only(host):
    """Whether `host` is a name this machine resolves to loopback addresses
    alone, not a loopback spelling (127.0.0.1, localhost, ::1): Debian and
    Ubuntu map a machine's own name to 127.0.1.1 in /etc/hosts, so on node 0
    --rdzv node-a:PORT would listen where no other node can reach."""
    if loopback(host):
        return False
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    return bool(found) and all(loopback(a) for a in found)


def _send(conn, message):
    conn.sendall((json.dumps(message) + "\n").encode())


class _Lines:
    """Reads JSON lines from a socket; None at end of stream."""

    def __init__(self, conn):
        self._file = conn.makefile("rb")

    def read(self):
        raw = self._file.readline()
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"garbled": raw[:80].decode(errors="replace")}


def _aggregation(value):
    """A node's --node-aggregation (False, "leader" or "sharded"), in words."""
    if not value:
        return "no --node-aggregation"
    return "--node-aggregation" if value == "leader" else f"--node-aggregation={value}"


class Store:
    """Node 0's side: accepts the other nodes' joins, checks that they agree
    with this node, hands them the job, and collects how each one ends."""

    def __init__(self, address, nnodes, nproc_per_node, config, servers, timeout, aggregation=False):
        self._address = address
        self._host, port = split_address(address)
        self._nnodes, self._nproc = nnodes, nproc_per_node
        self._aggregation = aggregation or False
        self._config, self._servers = config, servers
        self._timeout = timeout
        self._cond = threading.Condition()
        self._peers = {}  # node rank -> connection
        self._problem = None  # why the job cannot start
        self._published = False
        self._events = queue.Queue()  # (node, code, why); code None: lost
        # This node's address as the first node to join reached it.
        self.local_address = None
        self._listener = self._listen(self._host, port)
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def _listen(host, port):
        # HOST is how the other nodes reach this one; where it is not an
        # address of this machine (a name behind NAT), or a name this
        # machine gives loopback alone (loopback_only), listen on every one.
        for where in ((host, "") if not loopback_only(host) else ("",)):
            try:
                return socket.create_server((where, port), reuse_port=False)
            except OSError as e:
                if e.errno == 98:  # EADDRINUSE
                    raise RendezvousError(
                        f"cannot listen for the rendezvous on port {port}: it is in use "
                        f"(another job's morse-run?); pick another --rdzv port") from e
                last = e
        raise RendezvousError(f"cannot listen for the rendezvous on {host}:{port}: {last}")

    def _accept(self):
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, peer[0]), daemon=True).start()

    def _check(self, hello):
        if not isinstance(hello, dict) or hello.get("version") != VERSION:
            return (f"a node speaks rendezvous version {hello.get('version') if isinstance(hello, dict) else '?'}"
                    f", this one {VERSION}: run the same Morse on every node")
        node, who = hello.get("join"), f"node {hello.get('join')} ({hello.get('host')})"
        if hello.get("nnodes") != self._nnodes:
            return f"{who} has --nnodes {hello.get('nnodes')}, node 0 {self._nnodes}: every node must give the same"
        if hello.get("nproc_per_node") != self._nproc:
            return (f"{who} has --nproc-per-node {hello.get('nproc_per_node')}, node 0 {self._nproc}: "
                    f"every node must give the same")
        if (hello.get("aggregation") or False) != self._aggregation:
            return (f"{who} has {_aggregation(hello.get('aggregation'))}, node 0 "
                    f"{_aggregation(self._aggregation)}: every node must give the same")
        if not isinstance(node, int) or not 0 < node < self._nnodes:
            return f"{who}: --node-rank must be 1 to {self._nnodes - 1} on the nodes that join node 0"
        if node in self._peers:
            return f"two nodes say --node-rank {node}: give each node its own"
        if hello.get("config") is not None and hello["config"] != self._config:
            return f"{who} has a different --config from node 0's: give every node the same file"
        if hello.get("servers") != self._servers:
            return f"{who} has --servers {hello.get('servers')}, node 0 {self._servers}: every node must give the same"
        if self._published:
            return f"{who} joined after the job started"
        return None

    def _serve(self, conn, host):
        conn.settimeout(self._timeout)
        lines = _Lines(conn)
        try:
            hello = lines.read()
        except OSError:
            conn.close()
            return
        if hello is None:
            conn.close()
            return
        if isinstance(hello, dict):
            hello.setdefault("host", host)
        with self._cond:
            problem = self._check(hello)
            if problem is None:
                self._peers[hello["join"]] = conn
                if self.local_address is None:
                    try:
                        self.local_address = conn.getsockname()[0]
                    except OSError:
                        pass
                self._cond.notify_all()
        if problem is not None:
            # The refused node hears why before node 0 may give up and exit.
            self._tell(conn, {"error": problem})
            conn.close()
            with self._cond:
                if self._problem is None:
                    self._problem = problem
                self._cond.notify_all()
            return
        node = hello["join"]
        conn.settimeout(None)
        while True:
            try:
                message = lines.read()
            except OSError:
                message = None
            if message is None:
                self._events.put((node, None, "its morse-run went away (killed, or its host or network failed)"))
                return
            if "exit" in message:
                self._events.put((node, int(message["exit"]), message.get("why", "")))
                return

    @staticmethod
    def _tell(conn, message):
        try:
            _send(conn, message)
        except OSError:
            pass

    def wait_for_nodes(self):
        """Returns once every node has joined; raises RendezvousError on a
        disagreement or when some have not joined within the timeout (and
        tells those that did why the job will not start)."""
        deadline = time.time() + self._timeout
        with self._cond:
            while self._problem is None and len(self._peers) < self._nnodes - 1:
                left = deadline - time.time()
                if left <= 0:
                    missing = [n for n in range(1, self._nnodes) if n not in self._peers]
                    self._problem = (f"node{'s' if len(missing) > 1 else ''} "
                                     f"{', '.join(map(str, missing))} of {self._nnodes} did not join the "
                                     f"rendezvous at {self._address} within {self._timeout:g} s "
                                     f"(--rdzv-timeout): start morse-run with the same command there")
                    break
                self._cond.wait(min(left, 1.0))
            problem = self._problem
        if problem is not None:
            self.abort(problem)
            raise RendezvousError(problem)

    def publish(self, servers, world_size, master_port):
        with self._cond:
            self._published = True
            peers = dict(self._peers)
        job = {"servers": servers, "config": self._config, "world_size": world_size,
               "master_port": master_port}
        for conn in peers.values():
            self._tell(conn, {"job": job})

    def abort(self, why, code=1):
        """Tells every joined node to stop (or not to start), with why."""
        with self._cond:
            started, self._published = self._published, True
            peers = dict(self._peers)
        for conn in peers.values():
            self._tell(conn, {"stop": why, "code": code} if started else {"error": why})

    def next_event(self):
        """(node, code, why) for a node whose ranks ended (code None: the
        node was lost), or None if none has."""
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None

    def close(self):
        self._listener.close()
        with self._cond:
            peers = dict(self._peers)
        for conn in peers.values():
            try:
                conn.close()
            except OSError:
                pass


class Member:
    """A node other than node 0: joins node 0's store and learns the job;
    then hears whether node 0 stops it, and reports how its ranks ended."""

    def __init__(self, address, node_rank, nnodes, nproc_per_node, config, servers, timeout,
                 aggregation=False):
        self._address = address
        host, port = split_address(address)
        deadline = time.time() + timeout
        self._conn = None
        while self._conn is None:
            try:
                self._conn = socket.create_connection((host, port), timeout=5)
            except OSError as e:
                if time.time() >= deadline:
                    raise RendezvousError(
                        f"no rendezvous at {address} within {timeout:g} s (--rdzv-timeout): {e.strerror or e}; "
                        f"start node 0's morse-run with the same --rdzv") from e
                time.sleep(0.5)
        # This node's address on the way to node 0 (its gloo interface's).
        self.local_address = self._conn.getsockname()[0]
        _send(self._conn, {"version": VERSION, "join": node_rank, "nnodes": nnodes,
                           "nproc_per_node": nproc_per_node, "host": socket.gethostname(),
                           "config": config, "servers": servers, "aggregation": aggregation})
        # Node 0 answers once every node has joined (its timeout) and its
        # shards are up (their start).
        self._conn.settimeout(timeout + 60)
        self._lines = _Lines(self._conn)
        try:
            answer = self._lines.read()
        except OSError as e:
            raise RendezvousError(f"node 0 at {address} did not answer the join: {e}") from e
        if answer is None:
            raise RendezvousError(f"node 0 at {address} closed the rendezvous before the job started (its output says why)")
        if "error" in answer or "stop" in answer:
            raise RendezvousError(answer.get("error") or answer.get("stop"))
        if "job" not in answer:
            raise RendezvousError(f"node 0 at {address} answered the join with {answer}")
        self.job = answer["job"]
        self._conn.settimeout(None)
        self._stop = queue.Queue()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self):
        try:
            message = self._lines.read()
        except OSError:
            message = None
        if message is None:
            self._stop.put(("lost the rendezvous with node 0 at "
                            f"{self._address} (its morse-run ended or its host or network failed)", 1))
        elif "stop" in message:
            self._stop.put((message["stop"], int(message.get("code", 1))))
        else:
            self._stop.put((f"node 0 said {message}", 1))

    def stopped(self):
        """(why, code) once node 0 has stopped the job or was lost, else None."""
        try:
            return self._stop.get_nowait()
        except queue.Empty:
            return None

    def report(self, code, why=""):
        try:
            _send(self._conn, {"exit": code, "why": why})
        except OSError:
            pass

    def close(self):
        try:
            self._conn.close()
        except OSError:
            pass
