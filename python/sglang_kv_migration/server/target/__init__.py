"""The target role: a rank receiving KV. The allocate -> commit / abort / expire state
machine (`pending.py`) and the quarantine of slots a granted write may still reach
(`quarantine.py`), the commit (`commits.py`), commits of receipts a same-host source
left in the mailbox (`mailbox_commits.py`), allocations (`allocations.py`) and those
asked through the allocate channel (`channel_allocations.py`); `role.py` holds them
together, `build.py` builds them."""
