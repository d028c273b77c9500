"""The wire-protocol version carried by every cross-server message (session info's
`protocol_version`, every layout fingerprint).

History:
  1 - host pool -> host pool over Mooncake TE.
  2 - data paths: session info lists each rank's `paths` (device: CUDA IPC on one host;
      host: Mooncake) and a `server_epoch`; allocate takes `path`, `index_format`
      ("pages" puts page ids on the wire) and `nothing_ok`; transfer targets carry
      `path`, `kv_pages`, `device_kv`. Protocol-1 fields keep their meaning.

Additions no older peer can receive are advertised in session info `features` instead
of a version bump (clients use one only when both servers list it): `features.py`. A
new data path is advertised by its entry in `paths` the same way: a client sends a
target entry of path `shared_host` (with `shared_host_kv`) only when both servers list
that path.
"""

PROTOCOL_VERSION = 2
