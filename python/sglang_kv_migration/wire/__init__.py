"""The wire contract between migration clients and servers, written once.

`version.py`: the protocol version and its history; `features.py`: every optional wire
feature a server may list in its session info; `messages.py`: the request and reply
models; `bodies.py`: what a request body may say; `convert.py`: bodies to JSON and reply
JSON to models, for clients. Nothing here imports SGLang, torch or `server/`: the
client reads the same models without SGLang installed.
"""
