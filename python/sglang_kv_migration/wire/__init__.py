"""The wire contract between migration clients and servers, written once.

`version.py`: the protocol version and its history; `features.py`: every optional wire
feature a server may list in its session info; `messages.py`: the request and reply
models. Nothing here imports SGLang, torch or `server/`: the client reads the same
models without SGLang installed.
"""
