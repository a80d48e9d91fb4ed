# Sourced by the bench/*_compare.sh scripts: one server process at a time, started in the
# background by the caller (which sets SERVER_PID), waited for, and always stopped.

SERVER_PID=

stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
  SERVER_PID=
}
trap stop_server EXIT

# Fails at once when the server exits during startup (a port in use, a bad flag), so that a
# benchmark never runs against another process that happens to answer on the same port.
wait_ready() {  # $1 = URL to poll, $2 = the server's log file
  for _ in $(seq 1 600); do
    if curl -sf "$1" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "server exited during startup:" >&2; tail -20 "$2" >&2; return 1
    fi
    sleep 1
  done
  echo "server not ready after 600s" >&2; return 1
}
