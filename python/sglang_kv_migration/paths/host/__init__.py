"""Host pool -> host pool through the Mooncake Transfer Engine (the only package that
imports `mooncake`): layout math, write plans, staging and the transport."""
