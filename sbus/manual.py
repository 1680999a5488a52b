"""What each command's manual says beyond its options: the text of the man pages
(`sbus.manpages`) and of ``sbus COMMAND --help`` (`sbus.cli`; pip installs no man pages).
Data only, so both can use it."""

from __future__ import annotations

__all__ = ["MANUAL"]

#: What each page says beyond the option list: for a user, not about the code.
#: (description paragraphs, examples as (command line, what it does), the docs/ page)
MANUAL: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    "serve": ("Runs the broker: on the socket systemd passes (socket activation), else on "
              "the socket file --address names, which it creates. Logs go to standard "
              "error (the journal under systemd). SIGTERM under systemd hands every client "
              "over to the next broker; SIGUSR2 restarts it in place the same way.",
              [("sbus serve --address /tmp/bus.sock", "a broker for this session"),
               ("sbus serve --max-message 1m --soft discard", "bigger messages; slow "
                "subscribers lose messages rather than queue them")], "systemd.md"),
    "pub": ("Publishes one message on KEY: PAYLOAD, or standard input when it is left out. "
            "--lines makes each line of standard input its own message. With --count, "
            "{n} and {time} in the payload are replaced per message.",
            [("sbus pub greetings/world hello", "one message"),
             ("journalctl -f | sbus pub --lines logs/journal", "a message per line"),
             ("sbus pub -c 10 -i 1 ticks 'tick {n} at {time}'", "ten messages, a second "
              "apart")], "cli.md"),
    "sub": ("Subscribes to every PATTERN and prints the messages as they come, until "
            "interrupted, --count messages, or --timeout seconds without one. Keys and "
            "payloads are other people's bytes: unless --format raw or %r asks for them as "
            "they are, control bytes and invalid UTF-8 are shown escaped. Patterns: * is "
            "one segment, a trailing / everything below, '' everything that is not secret.",
            [("sbus sub 'sensors/*/temp' logs/", "two patterns, KEY PAYLOAD per line"),
             ("sbus sub -n 1 --timeout 5 jobs/done", "wait at most 5 s for one message"),
             ("sbus sub -F '%t %k %x' ''", "time, key and hex payload of everything")],
            "cli.md"),
    "whoami": ("Prints the credentials path the broker sees for this connection, "
               "!/cred/GID/UID/PID: the prefix of the secret keys only this process may "
               "subscribe to.",
               [("sbus whoami", "prints e.g. !/cred/1000/1000/4242 (a new process, so a "
                 "new PID, each time)"),
                ("sbus whoami --address /run/user/1000/sbus.socket", "who the user bus "
                 "sees")], "protocol.md"),
    "status": ("Asks the broker about itself: totals, and the clients you may see (your own "
               "user's; every client for root) with their subscriptions, queues, drops and "
               "flood policy. --json prints the whole answer.",
               [("sbus status --json | jq '.clients[].patterns'", "every pattern you hold")],
               "protocol.md"),
    "ping": ("Measures round trips to the broker, like ping(8): each is a whoami question "
             "and its answer.", [("sbus ping -c 10 -i 0", "ten round trips at once")],
             "cli.md"),
    "bench": ("Measures publish/subscribe throughput and one-way latency against the running "
              "broker, like nats bench: publisher and subscriber processes on one key, a "
              "progress line on the terminal, and a table at the end. Subscribers use the "
              "block policy, so nothing is lost unless --lossy; drops and reordering are "
              "counted and make the exit status 1.",
              [("sbus bench --pub 2 --sub 4 --msgs 200000 --size 256", "six processes")],
              "performance.md"),
    "install-units": ("Writes the systemd units (sbus.socket, sbus.service) for this "
                      "installation of sbus, for the system or, with --user, for your user "
                      "manager, and reloads systemd.",
                      [("sbus install-units --user && systemctl --user start sbus.socket",
                        "a broker for your user")], "systemd.md"),
    "mount": ("Shows the bus as files under MOUNTPOINT: reading a path subscribes (even "
              "before anything was published there), writing a file publishes it as one "
              "message (appending with >> publishes each write). Quote patterns; a "
              "directory cannot be read, so a pattern ending in / is spelled with the file "
              "** that every directory lists: cat 'MNT/a/*/**' for a/*/. MNT/.keyed/... "
              "prints each message after its key. Runs until interrupted or fusermount3 -u; "
              "--daemon returns once the mount is usable.",
              [("sbus mount --daemon /mnt/bus && cat '/mnt/bus/sensors/*/temp'",
                "subscribe to a pattern, before or after anyone publishes"),
               ("echo hi > /mnt/bus/a/b/c", "publish one message on a/b/c"),
               ("cat '/mnt/bus/.keyed/a/*/**'", "everything below a/X/, each line after "
                "its key"),
               ("tail -f log >> /mnt/bus/logs/web", "publish each line as it is written")],
              "fuse.md"),
    "record": ("Records the messages matching every PATTERN into a journal directory: "
               "segments of column blocks, sealed by size and age, old ones deleted by "
               "--keep and --keep-bytes. sbus analyze and the Spark data source read it.",
               [("sbus record --dir /var/lib/sbus/journal ''", "record everything")],
               "spark.md"),
    "journal": ("Reads a journal that sbus record wrote, without Spark: cat prints its "
                "messages (escaped lines, raw payloads or JSON), tail the last ones and, with "
                "-f, those recorded from then on; --pattern and --since narrow both. export "
                "writes each sealed segment as a zstd Parquet file that pyarrow, DuckDB, "
                "pandas, Polars and Spark read.",
                [("sbus journal tail -f --pattern 'sensors/*/temp' /var/lib/sbus/journal",
                  "follow one kind of key"),
                 ("sbus journal export /var/lib/sbus/journal --out /srv/parquet",
                  "Parquet for every tool")], "spark.md"),
    "analyze": ("Analyses a journal with Spark: per-key and per-prefix statistics and "
                "traffic per time window as Parquet, a report and a plot; or, with --stream, "
                "per-window rollups published back onto the bus.",
                [("sbus analyze /var/lib/sbus/journal --out report/", "a batch report")],
                "spark.md"),
    "gateway": ("Lets remote clients publish and subscribe over TCP or TLS (and publish over "
                "HTTPS) through one connection to the local broker. Publishers authenticate "
                "with the secret in --auth-key-file. It logs 'listening on HOST:PORT' with "
                "the real port, also for port 0.",
                [("sbus gateway --listen 0.0.0.0:7777 --auth-key-file /etc/sbus/key "
                  "--tls-cert cert.pem --tls-key key.pem", "a TLS gateway")], "gateway.md"),
    "request": ("Publishes a request on KEY and prints the first reply, which comes back on "
                "a private inbox (a secret key only this process can read). On a terminal "
                "the reply is shown escaped; into a pipe it goes as it is.",
                [("sbus request svc/upper hello", "prints HELLO if sbus reply serves it")],
                "protocol.md"),
    "reply": ("Answers the requests on PATTERN: runs COMMAND once per request with the "
              "request's body on its standard input and its key in $SBUS_KEY, and replies "
              "with what it prints. One request at a time.",
              [("sbus reply svc/upper -- tr a-z A-Z", "an upper-casing service")],
              "protocol.md"),
    "completion": ("Prints the completion script for bash or zsh: commands, options, "
                   "choices, files and directories.",
                   [("source <(sbus completion bash)", "in ~/.bashrc"),
                    ("sbus completion zsh > /usr/share/zsh/vendor-completions/_sbus",
                     "for every zsh user")], "cli.md"),
    "bridge": ("Joins the local bus to an MQTT broker (MQTT 5, paho-mqtt): messages on "
               "the --export patterns go out as MQTT topics, topics covered by the --import "
               "patterns come in as keys, each side under its own prefix (--export-map, "
               "--import-map). Keys MQTT cannot carry (+, #, invalid UTF-8, control "
               "characters) and secret keys are refused, never escaped; its own messages "
               "never come back (No Local and a user property). Local publishers never wait "
               "for MQTT. Both sides reconnect with backoff; under systemd, STATUS= shows "
               "the exported, imported, dropped, refused, looped and filtered counts.",
               [("sbus bridge --mqtt mqtt://broker:1883 --export sensors/ --export-map "
                 "sensors/=site/robot7/sensors/", "this host's sensors under its name"),
                ("sbus bridge --mqtt mqtts://broker:8883 --cafile ca.pem --import "
                 "'fleet/*/sensors/' --import-map fleet/=site/", "every host's sensors, "
                 "over TLS")], "bridge.md"),
    "top": ("sbus-top connects as an ordinary client, subscribes to the patterns given "
            "(everything that is not secret by default) and shows what flows: rates per "
            "key, payloads, recent messages, and the clients the broker lets you see (Tab). "
            "It is the same as sbus top. Without a broker at the start it says why and "
            "exits 1; a broker that goes away later is retried.\n\nKeys: q quit, p "
            "pause, s next sort column, r reverse the sort, / filter, g group by prefix, "
            "+ and - group depth, c clear, Tab the keys or the clients, arrows, PgUp/PgDn "
            "and Home/End scroll, ? help.",
            [("sbus-top 'sensors/*/temp' orders/", "watch two patterns"),
             ("sbus-top --json --seconds 5", "count for 5 s, print JSON")], "top.md"),
}
