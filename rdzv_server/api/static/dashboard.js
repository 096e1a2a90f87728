// The dashboard's script (served as a file: the page's Content-Security-Policy allows no
// inline script). With the browser's cookie (set by opening /?token=TOKEN once):
// - on /, it lists the jobs (GET /v1/jobs every LIST_MS);
// - on /jobs/ID, it shows that job: its state and pending reason, its lanes (the job over
//   time: one lane per node, one cell per round, coloured by the node's state in that round,
//   under a bar per round that counts every node), its nodes, the rounds it formed (how long
//   each took) and its timeline. Lanes and nodes come a page of PAGE nodes at a time
//   (GET /v1/jobs/ID?offset=O&limit=PAGE and /v1/jobs/ID/lanes?offset=O&limit=PAGE), so a
//   16,384-node job costs the browser no more than a 100-node one. The timeline is followed by long-polling
//   GET /v1/jobs/ID/events?since=SEQ&wait=S: new events are added at the top, nothing is
//   drawn again. The membership document and the lanes are fetched again when events arrive
//   or the page turns, the document also every MEMBERSHIP_MS for the heartbeat ages. Node rows are kept by node_id and only their
//   changed cells are written, so a 1,000-node job costs little per refresh.
// Polling stops at 401, 403 and 404 (only the operator can fix those), saying why.
//
// Rule: every value from the server (job ids, node ids, addresses, messages) enters the
// page as text (textContent, attribute properties), never through a sink that parses HTML.
'use strict';

const JOB_PATH = '/jobs/';
const LIST_MS = 2000; // the jobs table on /
const MEMBERSHIP_MS = 5000; // heartbeat ages on a job page are at most this old
const EVENTS_WAIT_S = 25; // one long-poll; the server holds it up to its --max-hold (30 s by default)
const RETRY_MS = 2000; // after a network error or a 5xx
const TIMELINE_ROWS = 2000; // rows kept on the page (the server keeps about 1,000 events a job)
const PAGE = 100; // nodes (and lanes) drawn at once; the pager shows the others
const STATE_WORDS = {
  member: 'member', joining: 'joining or waiting', standby: 'standby', left: 'left',
  failed: 'workers failed', cordoned: 'cordoned', refused: 'refused', dead: 'dead',
};
// A round's notes (events about the job, not one node), in a word under the round.
const NOTE_WORDS = { job_closed: 'closed', server_restarted: 'restart', host_cordoned: 'cordon', host_uncordoned: 'uncordon',
  fast_failure: 'fast', exit_barrier_released: 'released' };
const STOP_STATUSES = new Set([401, 403, 404]);
const NODE_HEADS = ['node rank', 'node id', 'host/addr', 'nproc', 'global ranks', 'status', 'heartbeat age'];
const KINDS = new Set(['job_created', 'job_closed', 'node_joined', 'round_formed', 'standby_promoted', 'node_departed',
  'join_refused', 'node_refused', 'host_cordoned', 'fast_failure', 'workers_failed', 'policy_changed']);
const EVENT_FIELDS = new Set(['seq', 'time', 'kind', 'cause', 'round', 'node_id', 'addr']);

// The job this page shows: /jobs/ID, or none on /.
const selected = location.pathname.startsWith(JOB_PATH)
  ? decodeURIComponent(location.pathname.slice(JOB_PATH.length)) : null;
let stopped = false;

// An element with text content (never parsed as markup) and an optional class.
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

// A table row; plain values become <td> text, nodes are appended as they are.
function row(cells, cls) {
  const tr = el('tr', null, cls);
  for (const cell of cells) tr.append(cell instanceof Node ? cell : el('td', cell));
  return tr;
}

function setText(node, text) {
  const value = text === undefined || text === null ? '' : String(text);
  if (node.textContent !== value) node.textContent = value;
}

function ranks(r) {
  if (!Array.isArray(r) || r.length === 0) return '';
  return r.length > 1 ? `${r[0]}-${r[r.length - 1]}` : `${r[0]}`;
}

function sleep(ms) { return new Promise(resolve => setTimeout(resolve, ms)); }

function pad(n, width) { return String(n).padStart(width, '0'); }

// A server-clock time as this browser's wall-clock time: the server sends its `now` with the events.
function wallTime(serverTime, serverNow, receivedAt) {
  const d = new Date(receivedAt - (serverNow - serverTime) * 1000);
  return `${pad(d.getHours(), 2)}:${pad(d.getMinutes(), 2)}:${pad(d.getSeconds(), 2)}.${pad(d.getMilliseconds(), 3)}`;
}

function seconds(s) { return typeof s === 'number' ? `${s.toFixed(s < 10 ? 2 : 1)} s` : ''; }

// ------------------------------------------------------------------------------ the notice

// The operator's way in when the server wants a token (401), or why the page stopped.
function showNotice(status, message) {
  const notice = document.getElementById('notice');
  const here = location.origin + location.pathname;
  notice.replaceChildren();
  if (status === 401) {
    notice.append(
      el('h2', 'This server requires a token'),
      el('p', 'Open this page once as'),
      el('p', null), // filled below with the address to open
      el('p', 'with TOKEN the contents of the server\u2019s token file, on the server\u2019s host: by default '
        + '~/.config/rdzv-server/token ($XDG_CONFIG_HOME/rdzv-server/token), or the file its --token-file names. '
        + 'The read-only token (the file --read-token-file names) is enough for this page. '
        + 'The server keeps the token in a cookie for this browser and takes it out of the address.'));
    notice.children[2].append(el('code', here + '?token=TOKEN'));
  } else if (status === 403) {
    notice.append(el('h2', 'This token may not see this'));
  } else if (status === 404) {
    notice.append(el('h2', `No job ${selected} on this server`),
      el('p', 'It never joined here, or it was closed and collected after the server\u2019s --job-ttl.'));
  } else {
    notice.append(el('h2', `The server answered ${status}`));
  }
  // A 401's own message is written for programs (token files, RDZV_TOKEN): the text above is the page's.
  if (message && status !== 401) notice.append(el('p', 'The server said: ' + message, 'muted'));
  if (STOP_STATUSES.has(status)) notice.append(el('p', 'The page stopped updating; reload it to try again.', 'muted'));
  notice.hidden = false;
}

function stop(status, message) {
  stopped = true;
  showNotice(status, message);
  document.getElementById('updated').textContent = '';
}

// GET a /v1 page: {ok, status, body}. Throws on a network error.
async function getJson(path) {
  const answer = await fetch(path, { credentials: 'same-origin', headers: { Accept: 'application/json' } });
  let body = null;
  try { body = await answer.json(); } catch (e) { body = null; }
  return { ok: answer.ok, status: answer.status, body };
}

function messageOf(answer) {
  return answer.body && typeof answer.body.message === 'string' ? answer.body.message : '';
}

// A failed answer: stop at 401/403/404, else say so and let the caller retry.
function failed(answer) {
  if (STOP_STATUSES.has(answer.status)) stop(answer.status, messageOf(answer));
  else if (answer.body && answer.body.error === 'not_leader') showFollower(answer.body.leader);
  else document.getElementById('updated').textContent = `server answered ${answer.status}; retrying`;
}

// A follower replica (--etcd) serves no jobs: point at the leader, and keep retrying here
// (this replica may lead next).
function showFollower(leader) {
  const notice = document.getElementById('notice');
  notice.replaceChildren(el('h2', 'This replica follows'));
  if (typeof leader === 'string' && /^https?:\/\/[^\s/]+$/.test(leader)) {
    const link = el('a', leader + location.pathname);
    link.href = leader + location.pathname;
    const line = el('p', 'The leader serves the jobs: ');
    line.append(link);
    notice.append(line, el('p', 'It asks for the token again the first time (the cookie belongs to each address).', 'muted'));
  } else {
    notice.append(el('p', 'No replica leads right now (an election is under way); this page retries.'));
  }
  notice.hidden = false;
  document.getElementById('updated').textContent = 'this replica follows; retrying';
}

// ------------------------------------------------------------------------------ /: the jobs

function jobRow(j) {
  const link = el('a', j.rdzv_id);
  link.href = JOB_PATH + encodeURIComponent(j.rdzv_id);
  const name = el('td');
  name.append(link);
  return row([name, el('td', j.state, 'state-' + j.state), j.round, j.num_nodes,
    `${j.min_nodes}..${j.max_nodes}`, j.world_size, j.pending], 'job');
}

async function followJobs() {
  document.getElementById('overview').hidden = false;
  while (!stopped) {
    try {
      const answer = await getJson('/v1/jobs');
      if (answer.ok) {
        document.getElementById('notice').hidden = true;
        const body = document.querySelector('#jobs tbody');
        const rows = document.createDocumentFragment();
        for (const j of (answer.body && answer.body.jobs) || []) rows.append(jobRow(j));
        body.replaceChildren(rows);
        document.getElementById('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
      } else {
        failed(answer);
      }
    } catch (e) {
      document.getElementById('updated').textContent = 'server unreachable: ' + e;
    }
    if (!stopped) await sleep(LIST_MS);
  }
}

// ------------------------------------------------------------------------------ a job: its nodes

// One of the node tables (nodes, joining, waiting, standby): rows kept by node_id.
class NodeTable {
  constructor(section) {
    this.section = section;
    const head = el('thead');
    head.append(row(NODE_HEADS.map(h => el('th', h))));
    this.body = el('tbody');
    const table = el('table', null, 'nodes');
    table.append(head, this.body);
    section.append(table);
    this.rows = new Map(); // node_id -> {tr, cells}
  }

  // `count`: the list's length over every page (a page may hold none of a list that has some).
  update(nodes, alwaysShown, count) {
    const list = Array.isArray(nodes) ? nodes : [];
    this.section.hidden = (typeof count === 'number' ? count : list.length) === 0 && !alwaysShown;
    const next = new Map();
    for (const n of list) {
      let r = this.rows.get(n.node_id);
      if (r === undefined || next.has(n.node_id)) {
        const cells = NODE_HEADS.map(() => el('td'));
        r = { tr: row(cells, 'node'), cells };
      }
      const age = typeof n.last_heartbeat_age_s === 'number' ? n.last_heartbeat_age_s.toFixed(1) + 's' : '';
      const values = [n.node_rank ?? '', n.node_id, n.addr, n.nproc_per_node, ranks(n.global_ranks), n.status, age];
      values.forEach((v, i) => setText(r.cells[i], v));
      const cls = n.alive ? 'alive' : 'dead';
      if (r.cells[5].className !== cls) r.cells[5].className = cls;
      next.set(n.node_id, r);
    }
    this.rows = next;
    // Move rows only when the order changed (a new round, a node gone).
    const kids = this.body.children;
    let same = kids.length === next.size;
    let i = 0;
    if (same) for (const r of next.values()) if (kids[i++] !== r.tr) { same = false; break; }
    if (!same) {
      const rows = document.createDocumentFragment();
      for (const r of next.values()) rows.append(r.tr);
      this.body.replaceChildren(rows);
    }
  }
}

const tables = {};

// The job-wide restart budget and why the job closed, where the server reports them (fleet control).
function fleetWords(j) {
  let words = '';
  if (typeof j.restarts === 'number') {
    words += `, restarts ${j.restarts}` + (typeof j.max_restarts === 'number' ? ` of ${j.max_restarts}` : ' (no budget)');
  }
  if (typeof j.closed_cause === 'string' && j.closed_cause) words += `, closed: ${j.closed_cause}`;
  return words;
}

// The job's effective settings and where each comes from (README "Job policy"): a policy
// (`policy PATTERN`), the nodes' own --nnodes / --rdzv-conf (`node`), or the default. Hidden
// for a server that does not say (no settings_source).
const SETTING_ORDER = ['min_nodes', 'max_nodes', 'last_call_timeout', 'join_timeout', 'heartbeat_ttl', 'max_restarts',
  'min_round_seconds', 'max_fast_failures'];

function settingText(v) {
  if (v === null || v === undefined) return v === null ? 'none' : '-';
  if (typeof v === 'boolean') return v ? '1' : '0';
  return String(v);
}

function showSettings(j) {
  const section = document.getElementById('settings-section');
  const sources = j.settings_source && typeof j.settings_source === 'object' ? j.settings_source : null;
  section.hidden = !sources;
  if (!sources) return;
  const keys = SETTING_ORDER.filter(k => k in j || k in sources)
    .concat(Object.keys(sources).filter(k => !SETTING_ORDER.includes(k)).sort());
  const byPolicy = keys.filter(k => String(sources[k] || '').startsWith('policy'));
  setText(document.getElementById('settings-note'),
    byPolicy.length ? `${byPolicy.length} from a policy: ${byPolicy.join(', ')}` : 'none from a policy');
  document.querySelector('#settings tbody').replaceChildren(...keys.map(k => {
    const tr = row([k, k in j ? settingText(j[k]) : '-', sources[k] || '']);
    tr.dataset.setting = k;
    if (String(sources[k] || '').startsWith('policy')) tr.lastChild.className = 'src-policy';
    return tr;
  }));
}

function showJob(j) {
  const summary = document.getElementById('summary');
  summary.replaceChildren(
    el('span', j.state, 'state-' + j.state),
    el('span', `, round ${j.round}, ${j.num_nodes} nodes (${j.min_nodes}..${j.max_nodes}), world size ${j.world_size}, `
      + `num_nodes_waiting ${j.num_nodes_waiting}` + fleetWords(j)));
  const pending = document.getElementById('pending');
  setText(pending, j.pending_reason ? 'Round pending: ' + j.pending_reason : '');
  pending.hidden = !j.pending_reason;
  const counts = j.counts || {};
  tables.nodes.update(j.nodes, true, counts.nodes);
  tables.joining.update(j.joining, false, counts.joining);
  tables.waiting.update(j.waiting, false, counts.waiting);
  tables.standby.update(j.standby, false, counts.standby);
  showProgress(j);
  showSettings(j);
  document.getElementById('updated').textContent = 'live, updated ' + new Date().toLocaleTimeString();
}

// The job's progress (README "A crash loop stops itself"): its steps over time (the steps its
// nodes' beats carried, and each round's last step), a dashed line where each round after the
// first formed (a restart; red when the round before it was a fast failure), the goodput and a
// row per round. Hidden until a round formed.
const SVG_NS = 'http://www.w3.org/2000/svg';

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function stepPoints(j) {
  const points = (Array.isArray(j.steps) ? j.steps : []).map(([t, round, step]) => ({ t, round, step }));
  for (const r of j.progress) {
    if (typeof r.step === 'number' && typeof r.ended_at === 'number') points.push({ t: r.ended_at, round: r.round, step: r.step });
  }
  return points.sort((a, b) => a.t - b.t);
}

function showProgress(j) {
  const section = document.getElementById('progress-section');
  const rounds = Array.isArray(j.progress) ? j.progress : [];
  section.hidden = rounds.length === 0;
  if (section.hidden) return;
  setText(document.getElementById('goodput'),
    typeof j.goodput === 'number' ? `goodput ${(j.goodput * 100).toFixed(1)} %` : 'goodput unknown (no progress reported)');
  setText(document.getElementById('fast-failures'), j.max_fast_failures > 0
    ? `fast failures in a row ${j.fast_failures} of ${j.max_fast_failures} (min_round_seconds ${j.min_round_seconds})`
    : 'crash-loop rule off (max_fast_failures=0)');
  const chart = document.getElementById('steps');
  const width = 720, height = 180, left = 50, bottom = 20, top = 10;
  const points = stepPoints(j);
  const t0 = rounds[0].formed_at;
  const last = rounds[rounds.length - 1];
  const t1 = Math.max(t0 + 1, last.ended_at ?? 0, ...points.map(p => p.t), last.formed_at + 1);
  const maxStep = Math.max(1, ...points.map(p => p.step));
  const x = t => left + (width - left - 10) * (t - t0) / (t1 - t0);
  const y = s => height - bottom - (height - bottom - top) * s / maxStep;
  const parts = [svg('text', { x: 4, y: top + 10, class: 'axis' }, maxStep), svg('text', { x: 4, y: height - bottom, class: 'axis' }, 0),
    svg('text', { x: left, y: height - 4, class: 'axis' }, `${(t1 - t0).toFixed(0)} s from round ${rounds[0].round}`)];
  rounds.forEach((r, i) => {
    if (i === 0) return;
    const fast = rounds[i - 1].fast_failure ? ' fast' : '';
    const line = svg('line', { x1: x(r.formed_at), x2: x(r.formed_at), y1: top, y2: height - bottom, class: 'restart' + fast });
    line.append(svg('title', {}, `round ${r.round} formed` + (fast ? ` after a fast failure (${rounds[i - 1].fast_failure})` : '')));
    parts.push(line);
  });
  for (const r of rounds) { // one line per round: a restart starts a new one
    const mine = points.filter(p => p.round === r.round);
    if (mine.length > 1) parts.push(svg('polyline', { class: 'line', points: mine.map(p => `${x(p.t)},${y(p.step)}`).join(' ') }));
    for (const p of mine) {
      const dot = svg('circle', { cx: x(p.t), cy: y(p.step), r: 3, class: 'point' });
      dot.append(svg('title', {}, `round ${p.round}: step ${p.step}`));
      parts.push(dot);
    }
  }
  chart.replaceChildren(...parts);
  const body = document.querySelector('#progress tbody');
  body.replaceChildren(...rounds.slice().reverse().map(r => {
    const ran = (typeof r.ended_at === 'number' ? r.ended_at : (j.now ?? r.formed_at)) - r.formed_at;
    const tr = row([r.round, typeof r.ended_at === 'number' ? seconds(ran) : 'running', r.step ?? '', r.fast_failure]);
    tr.dataset.round = r.round;
    if (r.fast_failure) tr.lastChild.className = 'fast';
    return tr;
  }));
}

// Membership fetches: one at a time; a request made meanwhile is served by one more fetch.
// The lanes change only with events (or another page): the timer's fetches leave them out.
let membershipBusy = false;
let membershipAgain = false;
let membershipTimer = null;
let lanesDue = true;

async function refreshMembership(withLanes = true) {
  if (stopped) return;
  lanesDue = lanesDue || withLanes;
  if (membershipBusy) { membershipAgain = true; return; }
  membershipBusy = true;
  clearTimeout(membershipTimer);
  const fetchLanes = lanesDue;
  lanesDue = false;
  try {
    const query = `offset=${pageOffset}&limit=${PAGE}`;
    const job = '/v1/jobs/' + encodeURIComponent(selected);
    const [membership, lanes] = await Promise.all([
      getJson(`${job}?${query}`), fetchLanes ? getJson(`${job}/lanes?${query}`) : null]);
    if (membership.ok && (lanes === null || lanes.ok)) {
      document.getElementById('notice').hidden = true;
      showJob(membership.body);
      if (lanes !== null) showLanes(lanes.body, Date.now());
      if (!drawn) { drawn = true; performance.mark('job-drawn'); } // the first complete page: tests time it
    } else {
      lanesDue = lanesDue || fetchLanes;
      failed(membership.ok ? lanes : membership);
    }
  } catch (e) {
    lanesDue = lanesDue || fetchLanes;
    document.getElementById('updated').textContent = 'server unreachable: ' + e;
  } finally {
    membershipBusy = false;
  }
  if (stopped) return;
  if (membershipAgain) { membershipAgain = false; refreshMembership(false); return; }
  membershipTimer = setTimeout(() => refreshMembership(false), MEMBERSHIP_MS);
}

// ------------------------------------------------------------------------------ a job: its lanes

let pageOffset = 0; // the first node (and lane) of the page shown
let drawn = false;
let lanesDrawn = ''; // what the lanes table shows, to draw it again only when it changed
let STATE_ORDER = Object.keys(STATE_WORDS); // weakest first; the server's own list replaces it

function showPager(page) {
  const total = page.total;
  if (pageOffset > 0 && pageOffset >= total) { // the job shrank under the page shown
    pageOffset = Math.max(0, Math.floor((total - 1) / PAGE) * PAGE);
    refreshMembership();
  }
  document.getElementById('pager').hidden = total <= PAGE;
  setText(document.getElementById('page-range'),
    `nodes ${Math.min(pageOffset + 1, total)}\u2013${Math.min(pageOffset + PAGE, total)} of ${total}`);
  document.getElementById('page-prev').disabled = pageOffset === 0;
  document.getElementById('page-next').disabled = pageOffset + PAGE >= total;
}

function turnPage(step) {
  pageOffset = Math.max(0, pageOffset + step * PAGE);
  refreshMembership();
}

function roundTitle(r, now, receivedAt) {
  const parts = [`round ${r.round}`];
  if (typeof r.formed_at === 'number') {
    parts.push(`formed at ${wallTime(r.formed_at, now, receivedAt)} in ${seconds(r.formation_s)} (${r.cause}): `
      + `${r.num_nodes} nodes, world size ${r.world_size}`);
    if (r.opened_by) parts.push(`after ${r.opened_by} on ${r.opened_by_node}`);
  }
  for (const n of r.notes) parts.push(`${n.kind} (${n.cause}) at ${wallTime(n.time, now, receivedAt)}`);
  return parts.join('\n');
}

// One bar per round: a segment per state, its height that state's share of every node.
function summaryCell(counts, total, round) {
  const td = el('td', null, 'bar');
  const words = [];
  for (let i = STATE_ORDER.length - 1; i >= 0; i--) { // the strongest on top
    const state = STATE_ORDER[i];
    const count = counts[state] || 0;
    if (count === 0) continue;
    const seg = el('div', null, 'seg st-' + state);
    seg.style.height = `${Math.max(1, Math.round(40 * count / Math.max(total, 1)))}px`; // one node in 16,384 still shows
    td.append(seg);
    words.push(`${STATE_WORDS[state] || state} ${count}`);
  }
  td.title = `round ${round}: ` + (words.join(', ') || 'no node');
  return td;
}

function showLanes(d, receivedAt) {
  if (Array.isArray(d.states)) STATE_ORDER = d.states;
  showPager(d.page);
  const note = d.first_seq > 1 ? `(events before #${d.first_seq} are no longer kept: earlier rounds may show fewer nodes)` : '';
  setText(document.getElementById('lanes-note'), note);
  const key = JSON.stringify([d.rounds, d.summary, d.lanes, d.page.total]);
  if (key === lanesDrawn) return;
  lanesDrawn = key;
  const head = el('thead');
  const numbers = row([el('th', 'round', 'label')]);
  const times = row([el('th', 'formed in', 'label')]);
  const bars = row([el('th', `all ${d.page.total} nodes`, 'label')], 'summary');
  const notes = row([el('th', '', 'label')], 'notes');
  let anyNote = false;
  d.rounds.forEach((r, i) => {
    const title = roundTitle(r, d.now, receivedAt);
    const number = el('th', r.round);
    number.title = title;
    numbers.append(number);
    const forming = r.round === d.round && d.state === 'open';
    const time = el('th', typeof r.formation_s === 'number' ? r.formation_s.toFixed(r.formation_s < 10 ? 2 : 0) + 's'
      : (forming ? 'forming' : ''));
    time.title = title;
    times.append(time);
    bars.append(summaryCell(d.summary[i] || {}, d.page.total, r.round));
    const words = [...new Set(r.notes.map(n => NOTE_WORDS[n.kind] || n.kind))];
    const cell = el('td', words.join(' '), 'note');
    cell.title = title;
    notes.append(cell);
    anyNote = anyNote || words.length > 0;
  });
  head.append(numbers, times, bars);
  if (anyNote) head.append(notes);
  const body = el('tbody');
  for (const lane of d.lanes) {
    const label = el('th', (typeof lane.node_rank === 'number' ? `${lane.node_rank}  ` : '') + lane.node_id
      + (lane.addr ? `  ${lane.addr}` : ''), 'label');
    label.title = `${lane.node_id} ${lane.addr || ''}`;
    const tr = row([label], 'lane');
    tr.dataset.nodeId = lane.node_id;
    lane.cells.forEach((state, i) => {
      const td = el('td', null, state ? 'cell st-' + state : 'cell');
      const round = d.rounds[i].round;
      if (state) {
        td.dataset.state = state;
        const cause = lane.causes[i];
        td.title = `${lane.node_id}, round ${round}: ${STATE_WORDS[state] || state}` + (cause ? ` (${cause})` : '');
      }
      tr.append(td);
    });
    body.append(tr);
  }
  document.getElementById('lanes').replaceChildren(head, body);
}

function showLegend() {
  const legend = document.getElementById('legend');
  for (const [state, words] of Object.entries(STATE_WORDS)) legend.append(el('span', words, 'st-' + state));
}

// ------------------------------------------------------------------------------ a job: its timeline

// The details of an event in words (round_formed, node_joined...), else key=value.
function details(e) {
  const rest = Object.keys(e).filter(k => !EVENT_FIELDS.has(k));
  if (e.kind === 'round_formed') {
    return `${e.num_nodes} nodes, world size ${e.world_size}, formed in ${seconds(e.formation_s)}`
      + (e.standby ? `, ${e.standby} standby` : '') + (e.opened_by ? `, after ${e.opened_by} on ${e.opened_by_node}` : '');
  }
  if (e.kind === 'workers_failed') { // each failed worker as the report words it
    const failures = (e.failures || []).map(f => `rank ${f.global_rank} (local ${f.local_rank}) `
      + (f.signal || `exit code ${f.exit_code}`) + (f.message && f.message !== (f.signal || `exit code ${f.exit_code}`) ? `: ${f.message}` : ''));
    return `node rank ${e.node_rank}, ${e.failed_workers} failed: ` + (failures.join('; ') || e.summary);
  }
  if (e.kind === 'policy_changed' && e.changes && typeof e.changes === 'object') { // each key: old -> new, and from where
    return `policy ${e.pattern} by ${e.by}: ` + Object.entries(e.changes)
      .map(([k, c]) => `${k} ${settingText(c.old)} \u2192 ${settingText(c.new)}` + (c.source ? ` (${c.source})` : '')).join(', ')
      + (e.held && typeof e.held === 'object' ? Object.entries(e.held).map(([k, why]) => `; held ${k}: ${why}`).join('') : '');
  }
  return rest.map(k => `${k}=${typeof e[k] === 'object' ? JSON.stringify(e[k]) : e[k]}`).join(' ');
}

function eventRow(e, now, receivedAt) {
  const kind = KINDS.has(e.kind) ? 'kind-' + e.kind : null;
  const tr = row([wallTime(e.time, now, receivedAt), e.round, e.kind, e.cause, e.node_id ?? '', e.addr ?? '', details(e)],
    kind ? 'event ' + kind : 'event');
  tr.dataset.seq = String(e.seq);
  return tr;
}

function roundRow(e, now, receivedAt) {
  return row([e.round, wallTime(e.time, now, receivedAt), e.cause, e.num_nodes, e.world_size, e.standby ?? 0,
    seconds(e.formation_s)], 'round');
}

// Add one page of events (oldest first) at the top of the timeline and the rounds table.
function addEvents(page, since, receivedAt) {
  const timeline = document.querySelector('#timeline tbody');
  const rounds = document.querySelector('#rounds tbody');
  const newTimeline = document.createDocumentFragment();
  const newRounds = document.createDocumentFragment();
  const events = page.events;
  for (let i = events.length - 1; i >= 0; i--) {
    const e = events[i];
    newTimeline.append(eventRow(e, page.now, receivedAt));
    if (e.kind === 'round_formed') newRounds.append(roundRow(e, page.now, receivedAt));
  }
  if (page.first_seq > since + 1) {
    const gap = el('td', `events ${since + 1}..${page.first_seq - 1} are no longer kept`);
    gap.colSpan = 7;
    newTimeline.append(row([gap], 'gap'));
  }
  timeline.prepend(newTimeline);
  rounds.prepend(newRounds);
  while (timeline.rows.length > TIMELINE_ROWS) timeline.lastElementChild.remove();
}

async function followEvents() {
  let since = 0;
  let wait = 0; // the first page at once, then long-polls
  let hold = EVENTS_WAIT_S;
  while (!stopped) {
    let answer;
    try {
      answer = await getJson(`/v1/jobs/${encodeURIComponent(selected)}/events?since=${since}&wait=${wait}`);
    } catch (e) {
      document.getElementById('updated').textContent = 'server unreachable: ' + e;
      await sleep(RETRY_MS);
      continue;
    }
    if (answer.status === 400 && wait > 1) { // a server whose --max-hold is shorter
      hold = wait = Math.floor(wait / 2);
      continue;
    }
    if (!answer.ok) {
      failed(answer);
      if (!stopped) await sleep(RETRY_MS);
      continue;
    }
    const page = answer.body;
    if (page.events.length > 0) {
      addEvents(page, since, Date.now());
      if (since > 0) refreshMembership();
    }
    since = Math.max(since, page.next_seq - 1);
    wait = hold;
  }
}

// ------------------------------------------------------------------------------ start

if (selected === null) {
  followJobs();
} else {
  document.title = `${selected} \u2013 rdzv-server`;
  document.getElementById('job-name').textContent = selected;
  document.getElementById('job').hidden = false;
  for (const name of ['nodes', 'joining', 'waiting', 'standby']) {
    tables[name] = new NodeTable(document.getElementById('members-' + name));
  }
  showLegend();
  document.getElementById('page-prev').addEventListener('click', () => turnPage(-1));
  document.getElementById('page-next').addEventListener('click', () => turnPage(1));
  refreshMembership();
  followEvents();
}
