"""One key a webhook receiver (issue 31, item 4): ``outbox_destination_of``
makes the same destination of every spelling of a host, so a limit or a
learned rate cannot be bypassed by writing the host another way.

A webhook's destination is the URL's host, then its port unless it is the
scheme's default: lower case, trailing dots dropped, leading zeros of the port
dropped, and a host with letters outside ASCII in its IDNA form (NFKC, the
three IDNA full stops read as dots, each such label ``xn--`` and its Punycode,
RFC 3492), the name the connection resolves. ``HTTPS://Hooks.Example.COM.:0443/x``,
``https://hooks.example.com/x`` and ``https://hooks.example.com:443/y`` are one
destination, ``hooks.example.com``. A host that is no host name (``*``, the
key of a channel-wide limit) is the channel's unnamed destination ''.

The live and unresolved rows get their new key here (a redrive computes it
again anyway); ``outbox_destination`` rows of one receiver under several
spellings become one, an operator's limit kept.

Revision ID: 0019
Revises: 0018
"""

from alembic import op

from outbox.migrations import revision_module

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _schema() -> str:
    return str(revision_module("0009").install_schema())


# RFC 3492's encoder for one label (no "xn--"), on code points; pg_catalog.mod
# and pg_catalog.div, never the operators' % (a printed script doubles it).
PUNYCODE = """
CREATE FUNCTION outbox_punycode(label text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = {schema}, pg_temp
AS $fn$
DECLARE
    points integer[] := ARRAY(
        SELECT pg_catalog.ascii(c) FROM pg_catalog.regexp_split_to_table(label, '') AS c
    );
    total integer := pg_catalog.cardinality(points);
    output text := '';
    n integer := 128;
    delta integer := 0;
    bias integer := 72;
    handled integer := 0;
    basic integer;
    m integer;
    q integer;
    k integer;
    t integer;
    point integer;
BEGIN
    FOREACH point IN ARRAY points LOOP
        IF point < 128 THEN
            output := output || pg_catalog.chr(point);
        END IF;
    END LOOP;
    basic := pg_catalog.length(output);
    handled := basic;
    IF basic > 0 THEN
        output := output || '-';
    END IF;
    WHILE handled < total LOOP
        SELECT pg_catalog.min(p) INTO m FROM pg_catalog.unnest(points) AS p WHERE p >= n;
        delta := delta + (m - n) * (handled + 1);
        n := m;
        FOREACH point IN ARRAY points LOOP
            IF point < n THEN
                delta := delta + 1;
            ELSIF point = n THEN
                q := delta;
                k := 36;
                LOOP
                    t := CASE WHEN k <= bias THEN 1 WHEN k >= bias + 26 THEN 26 ELSE k - bias END;
                    EXIT WHEN q < t;
                    output := output || outbox_punycode_digit(t + pg_catalog.mod(q - t, 36 - t));
                    q := pg_catalog.div(q - t, 36 - t)::integer;
                    k := k + 36;
                END LOOP;
                output := output || outbox_punycode_digit(q);
                -- adapt the bias (RFC 3492 section 6.1)
                delta := CASE WHEN handled = basic THEN pg_catalog.div(delta, 700)::integer
                              ELSE pg_catalog.div(delta, 2)::integer END;
                delta := delta + pg_catalog.div(delta, handled + 1)::integer;
                k := 0;
                WHILE delta > 455 LOOP
                    delta := pg_catalog.div(delta, 35)::integer;
                    k := k + 36;
                END LOOP;
                bias := k + pg_catalog.div(36 * delta, delta + 38)::integer;
                delta := 0;
                handled := handled + 1;
            END IF;
        END LOOP;
        delta := delta + 1;
        n := n + 1;
    END LOOP;
    RETURN output;
END
$fn$
"""

PUNYCODE_DIGIT = """
CREATE FUNCTION outbox_punycode_digit(d integer) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = {schema}, pg_temp
AS $fn$
    SELECT pg_catalog.chr(CASE WHEN d < 26 THEN 97 + d ELSE 22 + d END)
$fn$
"""

# A host (no port) in its IDNA form, each label with letters outside ASCII
# Punycode-encoded; NULL for a host that IDNA cannot spell.
IDNA_HOST = """
CREATE FUNCTION outbox_idna_host(host text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = {schema}, pg_temp
AS $fn$
DECLARE
    labels text[];
    label text;
    result text[] := '{{}}';
BEGIN
    host := pg_catalog.lower(pg_catalog.normalize(
        pg_catalog.translate(host, U&'\\3002\\FF0E\\FF61', '...'), 'NFKC'));
    labels := pg_catalog.string_to_array(host, '.');
    FOREACH label IN ARRAY labels LOOP
        IF pg_catalog.octet_length(label) <> pg_catalog.length(label) THEN
            label := 'xn--' || outbox_punycode(label);
        END IF;
        result := result || label;
    END LOOP;
    RETURN pg_catalog.rtrim(pg_catalog.array_to_string(result, '.'), '.');
EXCEPTION WHEN OTHERS THEN
    RETURN NULL;
END
$fn$
"""

# The URL's scheme, its host (user info dropped; a bracketed IPv6 address or
# a name) and its port.
_URL = r"^([A-Za-z][A-Za-z0-9+.-]*)://(?:[^@/?#]*@)?(\[[^]/?#]*\]|[^:/?#]*)(?::([0-9]+))?"
# What a destination's host must be once canonical: host name labels (DNS
# allows "_" in names) or a bracketed IPv6 address.
_HOST = r"^([a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*|\[[0-9a-f:.]+\])$"

# PL/pgSQL rather than SQL: the trigger calls it on every insert, and a SQL
# function with a pinned path and subqueries cost ten times 0011's (measured:
# about 90 us a row against 7; this one about 9).
DESTINATION_OF = f"""
CREATE OR REPLACE FUNCTION outbox_destination_of(channel text, payload jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = {{schema}}, pg_temp
AS $fn$
DECLARE
    parts text[];
    host text;
    port text;
BEGIN
    IF channel = 'webhook' THEN
        parts := pg_catalog.regexp_match(payload ->> 'url', '{_URL}');
        IF parts IS NULL THEN
            RETURN '';
        END IF;
        host := pg_catalog.rtrim(pg_catalog.lower(parts[2]), '.');
        IF pg_catalog.octet_length(host) <> pg_catalog.length(host) THEN
            host := outbox_idna_host(host);
        END IF;
        IF host IS NULL OR host !~ '{_HOST}' THEN
            RETURN '';  -- "*" above all: never the key of a channel-wide limit
        END IF;
        port := NULLIF(pg_catalog.ltrim(parts[3], '0'), '');
        IF port IS NULL OR (port = '443' AND pg_catalog.lower(parts[1]) = 'https')
                OR (port = '80' AND pg_catalog.lower(parts[1]) = 'http') THEN
            RETURN host;
        END IF;
        RETURN host || ':' || port;
    ELSIF channel = 'sqs' THEN
        RETURN COALESCE(payload ->> 'queue_url', '');
    ELSIF channel = 'eventbridge' THEN
        RETURN COALESCE(payload ->> 'event_bus', '');
    END IF;
    RETURN '';
END
$fn$
"""

# 0011's, for the downgrade.
_OLD_WEBHOOK_HOST = (
    r"^[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/?#]*@)?(\[[^]/?#]*\](?::[0-9]+)?|[^:/?#]*(?::[0-9]+)?)"
)
OLD_DESTINATION_OF = f"""
CREATE OR REPLACE FUNCTION outbox_destination_of(channel text, payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = {{schema}}, pg_temp
AS $fn$
    SELECT COALESCE(CASE channel
        WHEN 'webhook' THEN
            pg_catalog.lower(pg_catalog.substring(payload ->> 'url', '{_OLD_WEBHOOK_HOST}'))
        WHEN 'sqs' THEN payload ->> 'queue_url'
        WHEN 'eventbridge' THEN payload ->> 'event_bus'
        END, '')
$fn$
"""

# The learned and limited rows of one receiver under several spellings: the
# canonical row keeps its own figures and takes an operator's limit from a
# spelling when it has none; the other spellings go (a learned rate is
# learned again at the first throttling answer).
MERGE_DESTINATIONS = """
WITH spelled AS (
    SELECT d.destination AS spelling,
           outbox_destination_of('webhook', pg_catalog.jsonb_build_object(
               'url', 'https://' || d.destination || '/')) AS canonical,
           d.limit_rate, d.limit_burst, d.limit_source
    FROM outbox_destination AS d
    WHERE d.channel = 'webhook' AND d.destination <> '*'
), renamed AS (
    INSERT INTO outbox_destination AS d
        (channel, destination, limit_rate, limit_burst, limit_source)
    SELECT DISTINCT ON (s.canonical)
        'webhook', s.canonical, s.limit_rate, s.limit_burst, s.limit_source
    FROM spelled AS s
    WHERE s.canonical <> s.spelling AND s.canonical <> ''
    ORDER BY s.canonical, s.limit_rate NULLS LAST
    ON CONFLICT (channel, destination) DO UPDATE SET
        limit_rate = COALESCE(d.limit_rate, EXCLUDED.limit_rate),
        limit_burst = CASE WHEN d.limit_rate IS NULL
                           THEN EXCLUDED.limit_burst ELSE d.limit_burst END,
        limit_source = COALESCE(d.limit_source, EXCLUDED.limit_source)
)
DELETE FROM outbox_destination AS d
USING spelled AS s
WHERE d.channel = 'webhook' AND d.destination = s.spelling AND s.canonical <> s.spelling
"""


def upgrade() -> None:
    schema = _schema()
    for statement in (PUNYCODE_DIGIT, PUNYCODE, IDNA_HOST, DESTINATION_OF):
        op.execute(statement.format(schema=schema))
    for table in ("outbox_message_live", "outbox_message_unresolved"):
        op.execute(
            f"UPDATE {table} SET destination = outbox_destination_of(channel, payload) "
            "WHERE channel = 'webhook' "
            "AND destination IS DISTINCT FROM outbox_destination_of(channel, payload)"
        )
    op.execute(MERGE_DESTINATIONS)


def downgrade() -> None:
    op.execute(OLD_DESTINATION_OF.format(schema=_schema()))
    op.execute("DROP FUNCTION outbox_idna_host(text)")
    op.execute("DROP FUNCTION outbox_punycode(text)")
    op.execute("DROP FUNCTION outbox_punycode_digit(integer)")
