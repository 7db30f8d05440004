"""The request path: validation, admission, placement, the two legs and the relay, framework-free."""
