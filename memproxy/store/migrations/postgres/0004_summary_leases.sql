-- At most one summarisation per session across every replica, as in SQLite's 0004_summary_leases.
CREATE TABLE summary_leases (
    session_pk BIGINT PRIMARY KEY REFERENCES sessions (pk) ON DELETE CASCADE,
    holder TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
