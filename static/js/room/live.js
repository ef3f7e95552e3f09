// A room's live source: watches the room over the page's shared websocket client (client.js) and
// sends the teacher's controls. The server pushes `room_update` messages under the id of the
// `room_watch` that asked for them; the first after each watch is the full state. When the
// connection drops, the watch ends with an error; once it is back, the room is watched again
// (and the view model starts afresh from the new full update).
//
//   const source = liveSource(getClient(), "K7QX2M9A");
//   const stop = source.start({ reset, update, error });
//   source.control("pause", {});   // -> a promise of the room_control_ok reply

export function liveSource(client, room) {
  return {
    kind: "live",
    start({ reset, update, error }) {
      let handle = null, stopped = false;
      const watch = () => {
        reset();
        handle = client.request({ type: "room_watch", room }, (msg) => {
          if (msg.type === "room_update") update(msg);
          else if (msg.type === "error" && msg.code !== "disconnected") error(msg);
          if (msg.type === "error") handle = null;
        });
      };
      client.ready().then(() => { if (!stopped) watch(); });
      const offStatus = client.onStatus((status) => {
        if (status === "closed") error({ code: "disconnected", message: "The connection to the server was lost; reconnecting…" });
        else if (status === "idle" && !stopped) { handle = null; watch(); }   // the server closed a quiet socket
        else if (status === "open" && !stopped) client.ready().then(() => { if (!stopped && !handle) watch(); });
      });
      return () => {
        stopped = true;
        offStatus();
        if (handle) client.send({ type: "room_unwatch", id: `${handle.id}-unwatch` });
      };
    },
    control(action, fields = {}) {
      return client.call({ type: "room_control", room, action, ...fields });
    },
  };
}
