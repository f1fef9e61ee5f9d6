// Command stargz-grpc: the stargz snapshotter as a containerd proxy plugin, for the
// benchmarks' eStargz peer (benchmarks/stargz_peer.py).
//
// Debian 12 ships the snapshotter's library (golang-github-containerd-stargz-snapshotter-dev)
// but not its daemon, containerd-stargz-grpc, and the library's `service` package cannot be
// built from Debian's sources (its resolver imports k8s.io/cri-api, which Debian does not
// package). So this daemon composes the two parts that service.go composes, minus the CRI
// keychain and resolver: the lazy filesystem (`fs`) and the overlay-based remote snapshotter
// (`snapshot`), served over gRPC on a unix socket with containerd's snapshot service adapter.
// Registries: plain HTTP for loopback hosts, HTTPS otherwise, no credentials (our registry
// runs on 127.0.0.1).
//
// It must not listen anywhere but its unix socket.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/contrib/snapshotservice"
	"github.com/containerd/containerd/log"
	"github.com/containerd/containerd/reference"
	"github.com/containerd/containerd/remotes/docker"
	stargzfs "github.com/containerd/stargz-snapshotter/fs"
	"github.com/containerd/stargz-snapshotter/fs/config"
	"github.com/containerd/stargz-snapshotter/fs/layer"
	"github.com/containerd/stargz-snapshotter/fs/source"
	"github.com/containerd/stargz-snapshotter/snapshot"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "", "unix socket to serve the snapshotter on")
	root := flag.String("root", "", "folder for the snapshots and the layer cache")
	noPrefetch := flag.Bool("no-prefetch", false, "do not prefetch the files the image marks")
	noBackground := flag.Bool("no-background-fetch", false, "do not fetch layers in the background")
	debug := flag.Bool("debug", false, "log at debug level")
	flag.Parse()
	if *address == "" || *root == "" {
		fmt.Fprintln(os.Stderr, "stargz-grpc: -address and -root are required")
		os.Exit(2)
	}
	if *debug {
		logrus.SetLevel(logrus.DebugLevel)
	}
	if err := serve(*address, *root, config.Config{
		NoPrefetch:        *noPrefetch,
		NoBackgroundFetch: *noBackground,
		NoPrometheus:      true, // nothing scrapes it, and it would need a TCP listener
	}); err != nil {
		fmt.Fprintf(os.Stderr, "stargz-grpc: %v\n", err)
		os.Exit(1)
	}
}

func serve(address, root string, cfg config.Config) error {
	ctx := log.WithLogger(context.Background(), log.L)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return err
	}
	// Root runs this daemon, so overlayfs's opaque-directory xattr is the trusted one.
	fs, err := stargzfs.NewFilesystem(filepath.Join(root, "stargz"), cfg,
		stargzfs.WithGetSources(source.FromDefaultLabels(registryHosts())),
		stargzfs.WithOverlayOpaqueType(layer.OverlayOpaqueTrusted))
	if err != nil {
		return fmt.Errorf("filesystem: %w", err)
	}
	sn, err := snapshot.NewSnapshotter(ctx, filepath.Join(root, "snapshotter"), fs,
		snapshot.AsynchronousRemove)
	if err != nil {
		return fmt.Errorf("snapshotter: %w", err)
	}
	defer sn.Close()

	server := grpc.NewServer()
	snapshotsapi.RegisterSnapshotsServer(server, snapshotservice.FromSnapshotter(sn))
	if err := os.MkdirAll(filepath.Dir(address), 0o700); err != nil {
		return err
	}
	if err := os.Remove(address); err != nil && !os.IsNotExist(err) {
		return err
	}
	listener, err := net.Listen("unix", address)
	if err != nil {
		return err
	}
	// SIGTERM/SIGINT: stop serving, then Close the snapshotter (it unmounts its layers).
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.GracefulStop()
	}()
	log.G(ctx).Infof("serving on %s", address)
	return server.Serve(listener)
}

// registryHosts: where the layers of a reference are fetched from. The library's fetcher
// calls the host client's Transport itself, so it must be set (fs.NewFilesystem's default
// leaves it nil and the daemon panics on the first lazy mount).
func registryHosts() source.RegistryHosts {
	client := &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	hosts := docker.ConfigureDefaultRegistries(docker.WithPlainHTTP(docker.MatchLocalhost),
		docker.WithClient(client))
	return func(spec reference.Spec) ([]docker.RegistryHost, error) {
		return hosts(spec.Hostname())
	}
}
