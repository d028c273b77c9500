"""The wire contract between migration clients and servers, written once.

`version.py`: the protocol version and its history; `features.py`: every optional wire
feature a server may list in its session info; `messages.py`: the request and reply
models; `host_fields.py`: the host path's destination fields they share; `bodies.py`:
what a request body may say; `convert.py`: bodies to JSON and reply JSON to models, for
clients; `binary_ids.py` and `page_ranges.py`: the compact encodings of ids and slots.
Nothing here imports SGLang, `server/` or any module of the package outside `wire/`
(the root modules stand on it), and torch and numpy only inside the functions that
convert tensors: the client reads the same models without SGLang installed.
"""
