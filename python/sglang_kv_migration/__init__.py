"""Runtime KV-cache migration between SGLang servers (overlay plugin for sglang==0.5.12).

Reading order: see README.md in this folder.
"""

__version__ = "0.1.0"

# Wire-protocol version carried by every cross-server message.
# History:
#   1 - host pool -> host pool over Mooncake TE (this release).
PROTOCOL_VERSION = 1
