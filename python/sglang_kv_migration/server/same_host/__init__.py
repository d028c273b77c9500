"""What only peers on one host use, to save the client's round trips: the allocate
channel through which a source's scheduler asks a target's for slots
(`allocate_channel.py`), and the shared-memory mailbox through which it hands the target
its receipts (`mailbox.py`)."""
