-- Which counter made a session's stored token counts (`TokenCounter.name`: a tiktoken encoding, or
-- `litellm:<model>`), or `*` once they are a mix: a turn on a model counted another way cannot
-- trust them, and checks what it sends by a count of its own. NULL for sessions stored before:
-- taken for the counter of their next turn.
ALTER TABLE sessions ADD COLUMN tokenizer TEXT;
