-- At most one summarisation per session across every process sharing the store: a lease with an
-- expiry, so a process that dies holding it does not block the session for good.
CREATE TABLE summary_leases (
    session_pk INTEGER PRIMARY KEY REFERENCES sessions (pk) ON DELETE CASCADE,
    holder TEXT NOT NULL,
    expires_at REAL NOT NULL
);
