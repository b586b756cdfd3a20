"""Memory: everything between a parsed chat request and the store, one module a step.

Imports flow one way, each module using only those listed before it:

- `shrink`: smaller forms of older messages (compact tool outputs, repeats sent once, the one
  head-and-tail truncator);
- `sent`: the older messages of a history as sent, worked out once and kept between turns;
- `fit`: the budget, and the pure function that fits a session snapshot into it;
- `reconcile`: the client's messages matched with the stored session;
- `retention`: idle TTLs and the sweep;
- `summaries`: the Summarizer, folding older turns into a rolling summary;
- `recall`: the left-out messages that match the question, chosen and framed as one block;
- `plan`: a parsed request and the session into what to send (the output reserve included);
- `record`: the finished turn as the store writes it.

The package imports nothing from the HTTP layer; `chat` and `admin` call into it.
"""
