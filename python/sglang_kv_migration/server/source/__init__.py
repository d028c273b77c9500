"""The source role: a rank sending its prefix's KV to a target. The transfers themselves
(validate, check the grant, start the data path's `SendJob`, reply with a receipt) without
stalling the loop (`transfers.py`), and the destinations a source was sent in full, which
a body may then name by digest (`known_destinations.py`); `build.py` builds the role."""
