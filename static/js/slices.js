// Long work cut into slices of a few milliseconds, each in its own task, so that input and frames
// get in between: at T=512 the grid's 72 thumbnails or the head view's lines done in one go would
// hold the page for a frame or more.

const SLICE_MS = 8; // the longest one slice holds the page

// A fresh task (scheduler.postTask where there is one: setTimeout(0) is clamped to 4 ms when nested).
function nextTask() {
  if (globalThis.scheduler?.postTask) return globalThis.scheduler.postTask(() => {}, { priority: "user-visible" });
  return new Promise((resolve) => setTimeout(resolve, 0));
}

// Runs jobs (functions) in order, at most `budget` ms of them per task (a job longer than that
// gets a task of its own). Resolves true when all ran, false once cancelled() said to stop.
export async function inSlices(jobs, cancelled, budget = SLICE_MS) {
  let i = 0;
  while (i < jobs.length) {
    await nextTask();
    if (cancelled()) return false;
    const start = performance.now();
    do jobs[i++](); while (i < jobs.length && performance.now() - start < budget);
  }
  return true;
}
