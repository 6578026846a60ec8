// Command imagetool writes an OCI image as a docker-archive tarball (what `ctr images import` reads)
// from layer tarballs made elsewhere, lowest first. The tests make the layers from Debian packages and
// the repository (tests/controlplane/image.py); no Docker daemon and no base image are needed.
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

func main() {
	var layers, env repeated
	flag.Var(&layers, "layer", "an uncompressed tar of files, lowest first (repeat)")
	flag.Var(&env, "env", "NAME=value of the image's environment (repeat)")
	ref := flag.String("ref", "", "the image's name, e.g. unbroken.test/unbroken:abc123")
	out := flag.String("out", "", "the docker-archive tarball to write")
	entrypoint := flag.String("entrypoint", "", "the image's entrypoint, comma-separated (none when empty)")
	user := flag.String("user", "", "the image's user (none when empty)")
	workdir := flag.String("workdir", "", "the image's working directory")
	flag.Parse()
	if err := write(layers, env, *ref, *out, *entrypoint, *user, *workdir); err != nil {
		fmt.Fprintln(os.Stderr, "imagetool:", err)
		os.Exit(1)
	}
}

func write(layers, env []string, ref, out, entrypoint, user, workdir string) error {
	if len(layers) == 0 || ref == "" || out == "" {
		return fmt.Errorf("-layer (at least one), -ref and -out are required")
	}
	image := empty.Image
	for _, path := range layers {
		layer, err := tarball.LayerFromFile(path)
		if err != nil {
			return fmt.Errorf("layer %s: %w", path, err)
		}
		if image, err = mutate.AppendLayers(image, layer); err != nil {
			return err
		}
	}
	config, err := image.ConfigFile()
	if err != nil {
		return err
	}
	config = config.DeepCopy()
	config.OS, config.Architecture = "linux", "amd64"
	config.Config = v1.Config{User: user, WorkingDir: workdir, Env: env}
	if entrypoint != "" {
		config.Config.Entrypoint = strings.Split(entrypoint, ",")
	}
	if image, err = mutate.ConfigFile(image, config); err != nil {
		return err
	}
	tag, err := name.NewTag(ref)
	if err != nil {
		return err
	}
	return tarball.WriteToFile(out, tag, image)
}
